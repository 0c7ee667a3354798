from longmoe.parallel.expert_parallel import ExpertDispatcher, all_to_all
from longmoe.parallel.mesh import Layout, build_layout, validate_layout

__all__ = ["ExpertDispatcher", "all_to_all", "Layout", "build_layout", "validate_layout"]
