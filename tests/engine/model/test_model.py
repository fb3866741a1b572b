"""Loading a Hugging Face causal LM from a local directory (no hub access)."""

from pathlib import Path

import pytest
import torch

from grpod.engine import Engine, EngineError
from grpod.engine.data.tokenizer import ARITH_CHARS, SPECIALS
from grpod.engine.model.policy import build_tiny_qwen2
from tests.engine.helpers import config


def _save_local_model(where: Path) -> None:
    """The tiny Qwen2 and a character-level fast tokenizer that adds its BOS (as Llama's
    does), saved as a user would have them."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate([*SPECIALS, *ARITH_CHARS])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    core.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", SPECIALS.index("<bos>"))]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>"
    )
    build_tiny_qwen2(len(vocab)).save_pretrained(where, safe_serialization=True)
    tokenizer.save_pretrained(where)


def test_a_local_directory_trains_like_the_built_in_model(tmp_path: Path) -> None:
    _save_local_model(tmp_path / "model")
    local = Engine(config(model=str(tmp_path / "model")))
    builtin = Engine(config())
    assert local.tokenizer.encode("3+4=") == builtin.tokenizer.encode("3+4=")
    for name, tensor in builtin.model.state_dict().items():
        assert torch.equal(local.model.state_dict()[name], tensor), name
    a, b = local.rollout(), builtin.rollout()
    assert torch.equal(a.input_ids, b.input_ids)
    assert local.accumulate(a).loss == builtin.accumulate(b).loss


def test_bad_model_paths_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(EngineError, match="not 'tiny-qwen2' and not a local directory"):
        Engine(config(model=str(tmp_path / "absent")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(EngineError, match=r"no \*\.safetensors weights"):
        Engine(config(model=str(tmp_path / "empty")))
