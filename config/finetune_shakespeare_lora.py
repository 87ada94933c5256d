# LoRA fine-tune of a GPT-2 124M checkpoint (from config/train_gpt2.py) on Shakespeare with GPT-2 BPE tokens:
#   python -m data.shakespeare.prepare
#   python train.py config/finetune_shakespeare_lora.py --init_from=out-gpt2/ckpt.pt
#   python sample.py --out_dir=out-shakespeare-lora     # the base with the adapters merged in
# Only rank-8 adapters on the attention layers train; the checkpoints hold them and the base's path (a few MB).

out_dir = "out-shakespeare-lora"
init_from = "out-gpt2/ckpt.pt"
eval_interval = 5
eval_iters = 40
log_interval = 1
always_save_checkpoint = False

dataset = "shakespeare"
batch_size = 1
gradient_accumulation_steps = 32
block_size = 1024

# the model's shape (12 layers x 768, biases, its vocabulary) is the checkpoint's
dropout = 0.0

lora_rank = 8
lora_alpha = 16.0
lora_targets = "c_attn,c_proj"
lora_dropout = 0.05

learning_rate = 1e-3  # adapters start at zero and are few: a far larger learning rate than a full fine-tune's
weight_decay = 0.0
decay_lr = False
max_iters = 100
