"""longmoe.backends: one Backend per device vendor, picked through this registry.

    get_backend("cuda")   a named backend; raises if its device is not present
    active_backend()      $LONGMOE_BACKEND if set, else auto-detected; cached for the process
    list_backends()       registered names, in auto-detection order
    availability()        per name: None if it can run here, else why not

Vendor code (and vendor names) live only under this package: backends/<vendor>/ registers itself
in registry.py when imported at the bottom of this file.
"""

from longmoe.backends.registry import (AUTO, DETECTION_ORDER, ENV_VAR, active_backend,  # noqa: F401
                                       availability, backend_classes, detect_backend_name,
                                       get_backend, list_backends, register,
                                       reset_active_backend)

# Each vendor package registers its backend when imported; detection order is DETECTION_ORDER.
from longmoe.backends import cpu, cuda, rocm  # noqa: E402,F401
