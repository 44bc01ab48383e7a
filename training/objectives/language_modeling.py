"""Language modeling: token windows in, the next token's logits out at every position.

Loss: cross-entropy per token. Metrics: loss (nats per token), perplexity, bits per
token and bits per byte (the tokenizer says how many bytes each id stands for, so
tokenizers compare). Baseline: a unigram model (add-one smoothed token frequencies).
Gate: test_loss, lower is better. A run shows sampled continuations of the evaluate
section's prompts; the registered model turns prompts into sampled text.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from training.data.spec import DataSpec
from training.errors import DataError
from training.objectives import TASKS, Generation, base
from training.objectives.base import Reader, Scored, ratio
from training.objectives.bootstrap import Bootstrap

# Baseline forward passes over token windows materialise (rows, context, vocab) log-probs;
# this bounds one batch of them (float32 elements) to keep memory small.
_BASELINE_ELEMENTS = 1 << 22
GENERATION_KEYS = ("max_new_tokens", "temperature", "top_k", "seed")


class TextTokenizer(Protocol):
    """What sampling needs from training.data.tokenizer.Tokenizer."""

    eot: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def token_bytes(self) -> np.ndarray: ...


class Objective(base.Objective):
    name = "language_modeling"
    metric_names = TASKS["language_modeling"].metric_names
    num_stats = 3  # summed NLL in nats, tokens, bytes those tokens stand for

    def __init__(self, data: DataSpec, tokenizer: TextTokenizer | None = None) -> None:
        super().__init__(data)
        self.vocab_size = int(data.vocab_size)
        self.tokenizer = tokenizer
        # Bytes per token id; None: no tokenizer given, every token counts as one byte.
        token_bytes = tokenizer.token_bytes() if tokenizer is not None else None
        self.token_bytes = (
            None if token_bytes is None else torch.as_tensor(token_bytes, dtype=torch.float64)
        )

    @classmethod
    def for_data(cls, data: DataSpec, tokenizer: TextTokenizer | None = None) -> Objective:
        if data.kind != "tokens" or not data.vocab_size:
            raise DataError(
                f"task.type is language_modeling but the shards hold {data.kind} data; "
                "use a text source (data.source: text or stdlib) and re-run ingest and shard"
            )
        if tokenizer is not None and len(tokenizer.token_bytes()) != data.vocab_size:
            raise DataError(
                f"the tokenizer describes {len(tokenizer.token_bytes())} token ids but the "
                f"shards' vocabulary has {data.vocab_size}; re-run shard to rebuild them together"
            )
        return cls(data, tokenizer)

    @property
    def output_size(self) -> int:
        return self.vocab_size

    def output_shape(self, input_shape: tuple[int, ...]) -> tuple[int, ...]:
        return (*input_shape, self.vocab_size)

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output.reshape(-1, output.shape[-1]).float(), target.reshape(-1))

    def batch_stats(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        flat = target.reshape(-1)
        logits = output.reshape(-1, output.shape[-1]).float()
        nll = F.cross_entropy(logits, flat, reduction="sum").to(torch.float64)
        tokens = torch.tensor(float(flat.numel()), dtype=torch.float64, device=flat.device)
        if self.token_bytes is None:
            byte_count = tokens
        else:
            if self.token_bytes.device != flat.device:
                self.token_bytes = self.token_bytes.to(flat.device)
            byte_count = self.token_bytes[flat].sum()
        return torch.stack([nll, tokens, byte_count])

    def row_stats(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        # A row is one window of tokens: the bootstrap resamples windows, not tokens.
        rows = target.shape[0]
        logits = output.reshape(-1, output.shape[-1]).float()
        nll = F.cross_entropy(logits, target.reshape(-1), reduction="none").to(torch.float64)
        nll = nll.reshape(rows, -1).sum(dim=1)
        tokens = torch.full_like(nll, float(target[0].numel() if rows else 0))
        if self.token_bytes is None:
            byte_count = tokens
        else:
            if self.token_bytes.device != target.device:
                self.token_bytes = self.token_bytes.to(target.device)
            byte_count = self.token_bytes[target.reshape(rows, -1)].sum(dim=1).to(torch.float64)
        return torch.stack([nll, tokens, byte_count], dim=1)

    def metrics(self, stats: torch.Tensor, prefix: str) -> dict[str, float]:
        nll, tokens, byte_count = stats.tolist()
        loss = ratio(nll, tokens)
        return {
            f"{prefix}_loss": loss,
            f"{prefix}_perplexity": math.inf if loss > 700 else math.exp(loss),  # no overflow
            f"{prefix}_bits_per_token": loss / math.log(2),
            f"{prefix}_bits_per_byte": ratio(nll, byte_count) / math.log(2),
        }

    def baseline(
        self,
        train_reader: Reader,
        test_reader: Reader,
        max_rows: int,
        bootstrap: Bootstrap | None = None,
    ) -> dict:
        # A unigram model: add-one smoothed token frequencies of the sampled train windows.
        _, targets = train_reader.gather(base.sample_rows(train_reader.num_rows, max_rows))
        counts = np.bincount(targets.reshape(-1), minlength=self.vocab_size) + 1.0
        log_probs = torch.from_numpy(np.log(counts / counts.sum())).float()
        context = test_reader.gather(np.arange(1))[0].shape[1] if test_reader.num_rows else 1
        rows_per_batch = max(1, _BASELINE_ELEMENTS // (context * self.vocab_size))
        return self.score_baseline(
            lambda windows: log_probs.expand(*windows.shape, self.vocab_size),
            test_reader,
            rows_per_batch,
            bootstrap,
        )

    # --- what a run shows ---------------------------------------------------------------

    def artifacts(
        self,
        model: nn.Module,
        scored: Scored,
        plots_dir: Path,
        generation: Generation,
        context: int | None,
    ) -> list[Path]:
        samples = plots_dir / "samples.txt"
        samples.write_text(sample_text(model, self._text_tokenizer(), generation, context))
        return [samples]

    def sampler(
        self, generation: Generation, context: int | None
    ) -> Callable[[nn.Module], str] | None:
        tokenizer = self._text_tokenizer()
        return lambda model: sample_text(model, tokenizer, generation, context)

    def _text_tokenizer(self) -> TextTokenizer:
        if self.tokenizer is None:
            raise DataError("sampling text needs the data's tokenizer: pass it to objective_for")
        return self.tokenizer

    # --- the registered model: prompts in, sampled text out -----------------------------

    def serve(self, model: nn.Module, model_input: Any, params: dict | None = None):
        """Each prompt's continuation, sampled with a generator seeded by `seed` alone, so
        a prompt gets the same text whatever else is in the batch."""
        import pandas as pd  # deferred: pandas is needed only where a model serves

        settings = generation_settings(params or {})
        if isinstance(model_input, pd.DataFrame):
            prompts = model_input["prompt"].tolist()
        elif isinstance(model_input, str):
            prompts = [model_input]
        else:
            prompts = list(model_input)
        tokenizer = self._text_tokenizer()
        texts = []
        for prompt in prompts:
            generator = _generator(model, settings["seed"])
            _, continuation = _continue(model, tokenizer, str(prompt), settings, None, generator)
            texts.append(tokenizer.decode(continuation))
        return pd.DataFrame({"text": texts})

    def signature(self, generation: Generation):
        """Prompts in, text out; the sampling settings are params whose defaults are the
        evaluate section's."""
        # Deferred: mlflow is an optional dependency of a training machine.
        import pandas as pd
        from mlflow.models import ModelSignature
        from mlflow.types import ColSpec, ParamSchema, ParamSpec, Schema

        settings = generation_settings(vars(generation))
        types = {"max_new_tokens": "long", "temperature": "double", "top_k": "long"}
        params = ParamSchema(
            [ParamSpec(key, types.get(key, "long"), settings[key]) for key in GENERATION_KEYS]
        )
        signature = ModelSignature(
            inputs=Schema([ColSpec("string", "prompt")]),
            outputs=Schema([ColSpec("string", "text")]),
            params=params,
        )
        prompts = list(generation.prompts or ["Hello"])[:2]
        return signature, pd.DataFrame({"prompt": prompts})


def generation_settings(generation: dict[str, Any]) -> dict[str, Any]:
    """max_new_tokens, temperature, top_k (0: none) and seed, with typed defaults."""
    return {
        "max_new_tokens": int(generation.get("max_new_tokens", 120)),
        "temperature": float(generation.get("temperature", 0.8)),
        "top_k": int(generation.get("top_k") or 0),
        "seed": int(generation.get("seed", 0)),
    }


def _generator(model: nn.Module, seed: int) -> torch.Generator:
    device = next(model.parameters()).device
    return torch.Generator(device=device).manual_seed(seed)


def _continue(
    model: nn.Module,
    tokenizer: TextTokenizer,
    prompt: str,
    settings: dict[str, Any],
    context: int | None,
    generator: torch.Generator,
) -> tuple[list[int], list[int]]:
    """(the prompt's ids, the sampled continuation's ids up to the end of the document).

    A prompt starts a document, and in training documents follow an end-of-document id;
    so does the prompt here (an empty prompt samples a document from its start)."""
    ids = [tokenizer.eot, *tokenizer.encode(prompt)]
    start = torch.tensor([ids], dtype=torch.long, device=next(model.parameters()).device)
    with torch.no_grad():
        out = generate(
            model,
            start,
            settings["max_new_tokens"],
            settings["temperature"],
            settings["top_k"] or None,
            context,
            generator=generator,
        )
    continuation = out[0, len(ids) :].tolist()
    if tokenizer.eot in continuation:  # the document ended: stop the text there
        continuation = continuation[: continuation.index(tokenizer.eot)]
    return ids, continuation


def sample_text(
    model: nn.Module, tokenizer: TextTokenizer, generation: Generation, context: int | None
) -> str:
    """A sampled continuation of each prompt, as one readable text.

    The same seed gives the same text, so samples of two evaluations differ only by the
    model. One generator runs through all prompts."""
    was_training = model.training
    model.eval()
    settings = generation_settings(vars(generation))
    generator = _generator(model, generation.seed)
    sections = []
    try:
        for number, prompt in enumerate(generation.prompts, start=1):
            ids, continuation = _continue(model, tokenizer, prompt, settings, context, generator)
            text = tokenizer.decode(ids[1:] + continuation)
            sections.append(f"=== sample {number}, prompt {prompt!r} ===\n{text}\n")
    finally:
        model.train(was_training)
    return "\n".join(sections)


@torch.no_grad()
def generate(
    model: nn.Module,
    ids: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    context: int | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Append `max_new_tokens` sampled tokens to `ids` (B, T) and return (B, T + new).

    The model sees at most its last `context` tokens (when None: the model's own `context`
    attribute, or every token for a model without one).
    `temperature` <= 0 picks the most likely token; `top_k` samples among the k most likely
    (None or 0: all). A seeded `generator` makes the samples reproducible. The model runs
    in eval mode (no dropout) and is put back in the mode it was in.
    """
    context = context or getattr(model, "context", None) or ids.shape[1] + max_new_tokens
    was_training = model.training
    model.eval()
    try:
        for _ in range(max_new_tokens):
            logits = model(ids[:, -context:])[:, -1, :].float()
            if temperature <= 0:
                next_id = logits.argmax(dim=-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k:
                    kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                probs = torch.softmax(logits, dim=-1)
                next_id = torch.multinomial(probs, 1, generator=generator)
            ids = torch.cat([ids, next_id.to(ids.dtype)], dim=1)
    finally:
        model.train(was_training)
    return ids
