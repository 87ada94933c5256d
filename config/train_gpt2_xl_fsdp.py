# GPT-2 XL (1.5B) on OpenWebText with FSDP: weights, gradients and AdamW state sharded over the GPUs
#   python -m data.openwebtext.prepare          # once; downloads from the Hugging Face hub
#   torchrun --standalone --nproc_per_node=4 train.py config/train_gpt2_xl_fsdp.py
# ~0.5M tokens per optimizer step: 8 batch x 1024 block x 64 micro-steps (16 per GPU on 4 GPUs, 8 on 8).
# Checkpoints: ckpt.pt with the full weights (sample.py reads it) and ckpt-<iter>.dcp/, the sharded optimizer
# state, which resumes on any number of GPUs.

out_dir = "out-gpt2-xl"
eval_interval = 1000
eval_iters = 100
log_interval = 10
always_save_checkpoint = True
init_from = "auto"  # a job restarted by torchrun --max-restarts continues from its last checkpoint

dataset = "openwebtext"
batch_size = 8
block_size = 1024
gradient_accumulation_steps = 64

n_layer = 48
n_head = 25
n_embd = 1600
dropout = 0.0
bias = True

parallelism = "fsdp"
activation_checkpointing = "block"  # recompute blocks in backward: less memory; "none" is faster where it fits

learning_rate = 2e-4
max_iters = 600000
lr_decay_iters = 600000
min_lr = 2e-5
weight_decay = 1e-1
beta1 = 0.9
beta2 = 0.95
warmup_iters = 2000
