"""Adapters that let an RL framework's own interfaces drive longmoe's policy-update API
(longmoe.api.PolicyTrainer). Each lives in its own subpackage and imports its framework only
there, so `import longmoe` never needs one installed:

  longmoe.integrations.verl    a verl training engine (backend "longmoe"); docs/integrations/verl.md
"""
