from longmoe.train.config import RunConfig, load_run_config

__all__ = ["RunConfig", "load_run_config"]
