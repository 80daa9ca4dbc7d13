"""The search driver: the stages in order, over a pool of worker processes."""
