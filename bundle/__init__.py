"""The bundle: one directory per deployment (manifest.json, step graphs, tokenizer, checkpoints) and the
typed artifacts made from it (acceptance.json, latency.json, plan.json), each written atomically and
stamped with what it depends on (specrt.bundle.artifacts)."""
