"""What train.py wires together: the runtime (runtime.py: device, dtype, ranks under torchrun, stop signals,
MFU), the model's placement over GPUs (parallel.py: DDP, FSDP; context.py: each sequence split over GPUs), what
the loop keeps and reports from step to step (progress.py: the training state, stop flags, throughput, log lines),
how a run ends and the line it ends with (ending.py), what a run's checkpoint holds and how a run continues from
one (state.py), and the checks before any step (preflight.py: settings, data, memory, out_dir)."""
