"""Checkpoints: what is on disk, who may write it, and how it is read back without trusting it.

    save.py       write a step directory (DCP shards, generator states, meta.json), digest it,
                  publish it atomically; drop the earlier steps an --overwrite run replaces,
                  and those beyond the newest K (retention)
    load.py       pick the checkpoint `latest` names, check it fits the run (ResumePoint), load it
    state.py      the state dict DCP sees: one key per expert, names without the recompute level
    directory.py  DIR/.lock (one run per directory), DIR/latest, step names, leftovers of saves
    manifest.py   manifest.json: every file's size and sha256, the run identity; meta.json
    safe.py       reading the pickled pieces (DCP metadata, shard entries, RNG files) without
                  running code from them
    verify.py     `longmoe checkpoint verify`

The training loop (longmoe.train) and PolicyTrainer (longmoe.api) call these; nothing here imports
either. The format and its rules: docs/checkpoints.md.
"""
