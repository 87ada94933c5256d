# GPT-2 XL (1.5B) on OpenWebText with FSDP: weights, gradients and AdamW state sharded over the GPUs
#   python -m data.openwebtext.prepare          # once; downloads from the Hugging Face hub
#   torchrun --standalone --nproc_per_node=4 train.py config/train_gpt2_xl_fsdp.py
# ~0.5M tokens per optimizer step: 16 batch x 1024 block x 32 micro-steps (8 per GPU on 4 GPUs, 4 on 8).
# The FSDP settings below are the fastest measured on H100 80GB cards (bench/NOTES.md, "FSDP, GPT-2 XL"): on 2 GPUs
# 1.06x one unsharded GPU's tokens/s per GPU and 49% MFU, 54 GiB a GPU, where one FSDP unit per block gave 0.59x.
# Checkpoints: ckpt.pt with the full weights (sample.py reads it) and ckpt-<iter>.dcp/, the sharded optimizer
# state, which resumes on any number of GPUs.

out_dir = "out-gpt2-xl"
eval_interval = 1000
eval_iters = 100
log_interval = 10
always_save_checkpoint = True
init_from = "auto"  # a job restarted by torchrun --max-restarts continues from its last checkpoint

dataset = "openwebtext"
batch_size = 16
block_size = 1024
gradient_accumulation_steps = 32

n_layer = 48
n_head = 25
n_embd = 1600
dropout = 0.0
bias = True

parallelism = "fsdp"
fsdp_blocks_per_unit = 8  # blocks gathered and reduced at once: the hooks of 6 units a pass, not of 48
fsdp_reshard_after_forward = False  # gathered weights kept for backward: one all-gather a pass, 3 GiB more
activation_checkpointing = "none"  # "block" recomputes blocks in backward: less memory, slower; for smaller cards

learning_rate = 2e-4
max_iters = 600000
lr_decay_iters = 600000
min_lr = 2e-5
weight_decay = 1e-1
beta1 = 0.9
beta2 = 0.95
warmup_iters = 2000
