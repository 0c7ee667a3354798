"""longmoe: long-sequence Mixture-of-Experts RL post-training, one recipe for NVIDIA and AMD GPUs.

Map of the package (each module is one concern):
  config        ModelConfig, presets, Hugging Face config import
  model/        the decoder-only MoE transformer (norm, rope, attention, moe, blocks)
  ops/          primitives with registries: linear cross-entropy, grouped GEMM, recompute
  parallel/     DeviceMesh layout, expert parallel dispatch/combine, FSDP2 wrapping
  data/         samples, sources, packing into the one batch type, balance across ranks
  train/        run config, the step's data policy, RL losses, the per-rank training loop, launcher
  checkpoint/   save and load, the directory lock, manifests and digests, verify
  paired/       candidate-vs-reference harness behind `longmoe paired` and the tests
  backends/     (longmoe.backends) per-vendor probes, timers, collective adapters, kernel configs
  tuning/       (longmoe.tuning) chunk-size defaults and tuner caches
"""

__version__ = "0.1.0"
