"""Prompts (raw / chat through the tokenizer's template), several stop ids, stop strings,
greedy sampling, and export of a checkpoint as a Hugging Face directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from grpod.engine import Engine, EngineError
from grpod.engine.rollout.sampler import Rollout
from grpod.engine.rollout.stop_strings import (
    cut_at_stop_strings,
    stop_token_ids,
    strip_stop_strings,
)
from grpod.engine.rollout.torch_sampler import sample
from grpod.engine.state.export import export_pretrained
from tests.engine.helpers import config
from tests.hfdir import CHAT_TEMPLATE, build_hf_dir


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    where = build_hf_dir(tmp_path_factory.mktemp("hf") / "model")
    generation = json.loads((where / "generation_config.json").read_text())
    generation["eos_token_id"] = [2, 0]  # <|im_end|> and <|endoftext|>
    (where / "generation_config.json").write_text(json.dumps(generation))
    return where


def _jsonl(where: Path) -> str:
    path = where / "t.jsonl"
    path.write_text(
        "\n".join(json.dumps({"prompt": f"What is {i}?", "answer": "7"}) for i in range(4))
    )
    return str(path)


def test_chat_prompts_render_the_tokenizer_template(hf_dir: Path, tmp_path: Path) -> None:
    engine = Engine(
        config(model=str(hf_dir), task=_jsonl(tmp_path), prompt_format="chat",
               system_prompt="Be brief.", seq_len=64)
    )  # fmt: skip
    text = engine.tokenizer.to_hf().decode(engine.encode_prompt("What is 3?"))
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 3?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    raw = Engine(config(model=str(hf_dir), task=_jsonl(tmp_path), seq_len=64))
    hf = raw.tokenizer.to_hf()
    assert raw.encode_prompt("What is 3?") == hf("What is 3?")["input_ids"]  # BOS as it adds
    assert hf.chat_template == CHAT_TEMPLATE
    assert raw.stop_token_ids == [0, 2]  # the tokenizer's eos and generation_config's list


def test_chat_needs_a_template() -> None:
    with pytest.raises(EngineError, match="prompt_format chat: the tokenizer has no chat_template"):
        Engine(config(prompt_format="chat"))
    assert Engine(config()).encode_prompt("1+2=") == [1, 4, 13, 5, 14]  # the char BOS


def test_several_stop_ids_and_greedy() -> None:
    engine = Engine(config())
    prompts = [[1, 4, 13, 5, 14]] * 8

    def run(stops, temperature=1.0, seed=0):
        return sample(engine.model, prompts, max_new_tokens=6, temperature=temperature,
                      top_p=1.0, eos_token_id=stops, pad_token_id=0,
                      generator=torch.Generator(engine.device).manual_seed(seed))  # fmt: skip

    free = run([2])
    first = free.completion_ids[:, 0].tolist()
    stopped = run([2, first[0]])  # the first row's first token now ends it
    assert stopped.mask[0].sum() == 1 and stopped.completion_ids[0, 0] == first[0]
    for i, token in enumerate(first):
        assert bool(stopped.mask[i, 1]) == (token not in (2, first[0]))
    greedy = run([2], temperature=0.0, seed=1)
    assert torch.equal(greedy.completion_ids, run([2], temperature=0.0, seed=2).completion_ids)
    with torch.no_grad():
        logits = engine.model(torch.tensor(prompts[:1], device=engine.device)).logits[0, -1].float()
    assert greedy.completion_ids[0, 0] == logits.argmax()
    assert torch.allclose(greedy.logprobs[0, 0], logits.log_softmax(-1).max())


def test_stop_strings_cut_after_the_completing_token() -> None:
    engine = Engine(config())
    tok = engine.tokenizer  # "0123456789+=": id = 3 + index
    ids = torch.tensor([[4, 13, 5, 14, 6], [7, 8, 9, 10, 2]])  # "1+2=3", "4567" then eos
    rollout = Rollout(ids, torch.full((2, 5), -0.5), torch.tensor([[True] * 5, [True] * 5]))
    cut = cut_at_stop_strings(rollout, tok, ["2="])
    assert cut.mask.sum(-1).tolist() == [4, 5]  # ends with "=", the token completing "2="
    assert cut.completion_ids[0].tolist() == [4, 13, 5, 14, 0]
    assert cut.logprobs[0].tolist() == [-0.5] * 4 + [0.0]
    assert strip_stop_strings(tok.decode(cut.completion_ids[0].tolist()), ["2="]) == "1+"
    assert cut_at_stop_strings(rollout, tok, []) is rollout


def test_export_of_the_builtin_model_loads_and_generates(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = config()
    engine = Engine(cfg)
    checkpoint = engine.save_checkpoint(tmp_path / "ckpt")
    out = export_pretrained(cfg, checkpoint, tmp_path / "out")
    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer("1+2=")["input_ids"] == engine.encode_prompt("1+2=")
    ours = {k: v.cpu() for k, v in engine.model.state_dict().items()}
    assert all(torch.equal(v, ours[k]) for k, v in model.state_dict().items())
    generated = model.generate(torch.tensor([[1, 4, 13, 5, 14]]), max_new_tokens=3, do_sample=False)
    assert generated.shape[1] <= 8 and generated[0, :5].tolist() == [1, 4, 13, 5, 14]
    with pytest.raises(EngineError, match="exists and is not an empty directory"):
        export_pretrained(cfg, checkpoint, tmp_path / "out")
    assert stop_token_ids(engine.tokenizer, engine.model) == [2]


def test_a_chat_template_that_raises_is_one_line(hf_dir: Path) -> None:
    from transformers import AutoTokenizer

    from grpod.engine.data.tokenizer import HFTokenizerAdapter, encode_prompt

    tok = AutoTokenizer.from_pretrained(hf_dir)
    tok.chat_template = (  # as Gemma's: no system role
        "{% for m in messages %}{% if m['role'] == 'system' %}"
        "{{ raise_exception('System role not supported') }}{% endif %}{{ m['content'] }}"
        "{% endfor %}"
    )
    with pytest.raises(EngineError) as caught:
        encode_prompt(HFTokenizerAdapter(tok), "1+1=", "task t.jsonl", "chat", "Be brief.")
    assert str(caught.value) == (
        "task t.jsonl: prompt '1+1=': chat_template: TemplateError: System role not supported"
    )
