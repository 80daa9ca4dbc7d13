"""The target GPU: its spec, the resource model of a block, and instances checked against both."""
