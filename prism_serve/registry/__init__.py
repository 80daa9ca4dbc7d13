"""The kernel registry: verified sGraphs, instantiations and timings per program, dtype,
num_tokens bucket and device, in SQLite (default) or any SQLAlchemy database."""

from prism_serve.registry.db import Registry, open_registry, resolve_url
from prism_serve.registry.errors import RegistryError
from prism_serve.registry.store import (
                                        DeviceInfo,
                                        DeviceKernels,
                                        KernelResult,
                                        Versions,
                                        add_kernel,
                                        best_kernel,
                                        current_versions,
                                        load_device,
)

__all__ = [
                                        "DeviceInfo",
                                        "DeviceKernels",
                                        "KernelResult",
                                        "Registry",
                                        "RegistryError",
                                        "Versions",
                                        "add_kernel",
                                        "best_kernel",
                                        "current_versions",
                                        "load_device",
                                        "open_registry",
                                        "resolve_url",
]
