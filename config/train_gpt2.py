# GPT-2 124M on OpenWebText, on one node of 8 GPUs:
#   python -m data.openwebtext.prepare          # once; downloads from the Hugging Face hub
#   torchrun --standalone --nproc_per_node=8 train.py config/train_gpt2.py
# ~0.5M tokens per optimizer step: 12 batch x 1024 block x 40 micro-steps (5 per GPU on 8 GPUs).

out_dir = "out-gpt2"
eval_interval = 1000
eval_iters = 200
log_interval = 10
always_save_checkpoint = True

dataset = "openwebtext"
batch_size = 12
block_size = 1024
gradient_accumulation_steps = 5 * 8

n_layer = 12
n_head = 12
n_embd = 768
dropout = 0.0
bias = True  # GPT-2 has biases; keeps its weights loadable one to one

learning_rate = 6e-4
max_iters = 600000
lr_decay_iters = 600000
min_lr = 6e-5
weight_decay = 1e-1
beta1 = 0.9
beta2 = 0.95
warmup_iters = 2000
