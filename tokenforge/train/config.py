"""TrainConfig: every `tokenforge train` setting, validated once and frozen.

Validation here needs no model and no data (flag ranges and combinations); the checks that do
(data present and made by this model's tokenizer, batch divisibility by the world size, a
writable run directory) run in trainer.check_inputs, also before any compute.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tokenforge.train.optim import OPTIMIZERS, SCHEDULERS
from tokenforge.train.parallel import STRATEGIES


@dataclass(frozen=True, slots=True)
class TrainConfig:
    data: str
    output: str
    model: str | None = None            # None: the bundled model; GGUF, HF dir, earlier run, or config name
    load_format: str = "auto"           # dummy: random init from a config
    max_steps: int = 100
    lr: float = 3e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 10
    scheduler: str = "linear"
    optimizer: str = "adamw"
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    micro_batch_size: int = 4
    global_batch_tokens: int | None = None      # None: one micro batch per rank per step
    seq_len: int = 2048
    save_every: int = 0                 # 0: only at the end
    keep_last: int = 2
    eval_every: int = 0                 # 0: only at the end (when there is a validation split)
    eval_samples: int = 64
    log_every: int = 1
    strategy: str = "auto"              # auto: ddp under torchrun with several ranks, else none
    activation_checkpointing: bool = False
    compile: bool | None = None         # None: on CUDA
    dtype: str = "auto"                 # auto: bfloat16 on CUDA, float32 on the CPU
    export_dtype: str = "auto"          # auto: the compute dtype
    seed: int = 0
    resume: bool = False
    lora_rank: int = 0
    lora_alpha: float = 16.0
    lora_export: str = "merged"
    profile_dir: str | None = None
    device: str = "auto"
    verify_data: bool = True
    tensorboard: bool = True

    def validated(self) -> TrainConfig:
        positive = {"--max-steps": self.max_steps, "--micro-batch-size": self.micro_batch_size,
                    "--seq-len": self.seq_len, "--log-every": self.log_every}
        for flag, value in positive.items():
            if value < 1:
                raise ValueError(f"{flag} must be positive, got {value}")
        non_negative = {"--warmup-steps": self.warmup_steps, "--save-every": self.save_every,
                        "--keep-last": self.keep_last, "--eval-every": self.eval_every,
                        "--lora-rank": self.lora_rank, "--eval-samples": self.eval_samples}
        for flag, value in non_negative.items():
            if value < 0:
                raise ValueError(f"{flag} must be >= 0, got {value}")
        if self.lr <= 0 or not 0 <= self.min_lr_ratio <= 1:
            raise ValueError("--lr must be positive and --min-lr-ratio in [0, 1]")
        self._check_choice("--scheduler", self.scheduler, SCHEDULERS)
        self._check_choice("--optimizer", self.optimizer, OPTIMIZERS)
        self._check_choice("--strategy", self.strategy, ("auto", *STRATEGIES))
        self._check_choice("--dtype", self.dtype, ("auto", "bfloat16", "float32"))
        self._check_choice("--export-dtype", self.export_dtype, ("auto", "bfloat16", "float32", "float16"))
        self._check_choice("--lora-export", self.lora_export, ("merged", "adapter"))
        if self.global_batch_tokens is not None and self.global_batch_tokens % (self.micro_batch_size * self.seq_len):
            raise ValueError(f"--micro-batch-size {self.micro_batch_size} x --seq-len {self.seq_len} = "
                             f"{self.micro_batch_size * self.seq_len} tokens does not divide "
                             f"--global-batch-tokens {self.global_batch_tokens}")
        return self

    @staticmethod
    def _check_choice(flag: str, value: str, choices: tuple[str, ...]) -> None:
        if value not in choices:
            raise ValueError(f"{flag} must be one of {', '.join(choices)}, got {value!r}")

    def replace(self, **changes) -> TrainConfig:
        return dataclasses.replace(self, **changes).validated()


# Flags whose default depends on the mode (pretraining: TrainConfig's; `--draft-head`: its recipe,
# cli/train_eagle.py HEAD_RECIPE): the CLI leaves them None when not given.
MODE_FLAGS = ("max_steps", "lr", "warmup_steps", "scheduler", "micro_batch_size", "seq_len")


def config_values(flags: dict, defaults: dict) -> dict:
    """TrainConfig's fields from parsed flags: a MODE_FLAGS flag left None takes `defaults`' value,
    else TrainConfig's own default."""
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    values = {k: v for k, v in flags.items() if k in fields}
    for name in MODE_FLAGS:
        if values.get(name) is None:
            values.pop(name, None)
            if name in defaults:
                values[name] = defaults[name]
    return values
