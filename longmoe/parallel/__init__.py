from longmoe.parallel.expert_parallel import ExpertDispatcher
from longmoe.parallel.mesh import Layout, build_layout, validate_layout

__all__ = ["ExpertDispatcher", "Layout", "build_layout", "validate_layout"]
