"""longmoe.plan: the recipe planner.

  hardware.json / hardware.py   accelerator profiles as data, each figure with its source
  memory.py                     per-rank peak-memory estimate for a (TP, PP, EP, CP) layout
  planner.py                    EP, then TP, then CP, then PP, each with its reason; the 4-D grid
  cli.py                        `longmoe recipe` and the run-config writer
"""
