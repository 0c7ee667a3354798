"""verl drives longmoe: a training engine (backend "longmoe") for verl's workers and losses.

Importing this module registers the engine with verl's EngineRegistry; verl imports it itself
through the `verl.plugins` entry point in longmoe's package metadata. Needs the `verl` extra
(`pip install 'longmoe[verl]'`). docs/integrations/verl.md has the config lines to change.
"""

from longmoe.integrations.verl.config import LongMoEActorConfig, LongMoEEngineConfig
from longmoe.integrations.verl.engine import LongMoEEngine

__all__ = ["LongMoEActorConfig", "LongMoEEngineConfig", "LongMoEEngine"]
