# A 6.7B GPT (GPT-3 6.7B's shape: 32 layers, width 4096, 32 heads) on OpenWebText with FSDP, 4 to 8 GPUs.
# Its training state (float32 weights, gradients, AdamW moments: 16 bytes a parameter, 107 GB) does not fit one
# 80 GB card; FSDP shards it over the GPUs.
#   python -m data.openwebtext.prepare          # once; downloads from the Hugging Face hub
#   torchrun --standalone --nproc_per_node=4 train.py config/train_gpt_6.7b_fsdp.py
# ~0.5M tokens per optimizer step: 8 batch x 1024 block x 64 micro-steps (16 per GPU on 4 GPUs, 8 on 8). FSDP
# reduce-scatters the gradients at every micro-step, so accumulating keeps each GPU's shard of them, not all of them
# whole in float32 (26.6 GB more a GPU), and micro-batch 8 stays under an 80 GB card's memory.
# On H100s and H200s fp8="auto" (the default) trains this width with torchao's FP8 (tensorwise) matmuls. Measured on
# 4 H200s with these settings at 2 micro-steps a GPU (bench/results/h200-fsdp-6.7b-accumulated-299b5f8.md; tok/s a
# GPU, MFU of the bf16 peak, peak memory allocated): FP8 16,717 (70.2%, 52.3 GiB) against bf16's 12,795 (53.6%,
# 60.5 GiB): 1.31x.
# The earlier setting, micro-batch 4 with whole gradients, gave 13,734 against 11,654 (1.18x). On 141 GB cards
# fsdp_reshard_after_forward=False is 5% faster (17,540 FP8, 58.1 GiB; bf16 72.1 GiB); fp8="off" is bf16.
# One save writes ckpt-<iter>.pt (26.6 GB of float32 weights), best.pt and ckpt.pt (copies of it; clones that take
# no space on XFS or Btrfs) and ckpt-<iter>.dcp/ (53.2 GB of AdamW moments, sharded): 133 GB, 80 GB with clones.
# The sharded state resumes on any number of GPUs (saved on 4 H200s, resumed on 2 with activation_checkpointing=
# "block": bench/results/h200-fsdp-6.7b-save-9fb6b4f.log, -resume-9fb6b4f.log).

out_dir = "out-gpt-6.7b"
eval_interval = 1000
eval_iters = 100
log_interval = 10
always_save_checkpoint = True
init_from = "auto"  # a job restarted by torchrun --max-restarts continues from its last checkpoint

dataset = "openwebtext"
batch_size = 8
block_size = 1024
gradient_accumulation_steps = 64

n_layer = 32
n_head = 32
n_embd = 4096
dropout = 0.0
bias = False

parallelism = "fsdp"  # one FSDP unit per block, resharded after forward (the defaults)
fsdp_reduce_every_micro_step = True  # each GPU accumulates only its shard of the gradients
activation_checkpointing = "none"  # "block" recomputes blocks in backward: less memory, slower

learning_rate = 1.2e-4  # GPT-3 6.7B's
max_iters = 600000
lr_decay_iters = 600000
min_lr = 1.2e-5
weight_decay = 1e-1
beta1 = 0.9
beta2 = 0.95
warmup_iters = 2000
