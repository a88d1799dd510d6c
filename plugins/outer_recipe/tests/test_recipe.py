import asyncio
import json
import math
import tomllib

import pytest

from aitrainsai import AgentTask, ChatML, ScoredEpisode, Workspace, call_tool, parse_reply
from aitrainsai.testing import OuterTrainerConformance
from aitrainsai_outer_recipe.policy import RUBRICS, SUFFIXES, RecipePolicy, line_edits, rubric_source, write_job

TEMPLATE = {
    "environment.py": "# env\n",
    "rubric.py": "# rubric\n",
    "dataset.py": ('SEED = 1\nITEMS_PER_LEVEL = {1: 256}\n\ndef build():\n    rows = []\n'
                   '    rows.append({"question": item.question, "answer": item.answer, "world": item.world})\n'),
    "trainer.toml": 'base_model = "a"\nsteps = 20\nlearning_rate = 0.0002\ngroup_size = 8\n',
}


def task(family="calc_chain", held_out=False):
    return AgentTask(family=family, level=1, levels=[1, 2, 3], held_out=held_out, template=TEMPLATE,
                     family_module="aitrainsai_family_calc_chain.public",
                     allowed_bases=["a", "b"], max_train_steps=10, max_dataset_size=300)


class TestRecipeConformance(OuterTrainerConformance):
    trainer = RecipePolicy
    distribution = "aitrainsai-outer-recipe"


def sample(policy, t=None):
    return asyncio.run(policy.sample([{"role": "user", "content": "go"}], [], t or task()))


def apply_calls(root, template, calls) -> dict[str, str]:
    """The workspace's files after the calls, made as an episode makes them: the real workspace tools, started from
    the template; every call must succeed."""
    workspace = Workspace(root)
    for name, text in template.items():
        workspace.write_file(name, text)
    tools = {"write_file": workspace.write_file, "edit_file": workspace.edit_file}
    for call in calls:
        if call["function"]["name"] in tools:
            result = call_tool(tools, call["function"]["name"], call["function"]["arguments"])
            assert result.startswith(("wrote", "edited")), result
    return {path.name: path.read_text() for path in sorted(workspace.root.iterdir()) if path.is_file()}


def job_of(root, t, turn) -> dict[str, str]:
    return apply_calls(root, t.template, turn.message["tool_calls"])


def test_one_turn_writes_the_job_and_submits(tmp_path):
    turn = sample(RecipePolicy(RecipePolicy.Config(seed=3), state_dir=tmp_path))
    calls = turn.message["tool_calls"]
    names = [(c["function"]["name"], json.loads(c["function"]["arguments"])["path"]) for c in calls[:-1]]
    # the template's rubric.py is one comment, no line of which stays: written whole; the rest edited
    assert ("write_file", "rubric.py") in names and {n for n, _ in names} == {"write_file", "edit_file"}
    assert "environment.py" not in {path for _, path in names}  # unchanged: no call
    assert calls[-1]["function"]["name"] == "submit_job"
    assert len(turn.completion_tokens) == len(turn.logprobs) == len(turn.meta["decisions"])
    assert all(lp <= 0 for lp in turn.logprobs)
    # after the tool results come back it stops
    again = asyncio.run(RecipePolicy(RecipePolicy.Config(), state_dir=tmp_path).sample(
        [{"role": "tool", "content": "accepted"}], [], task()))
    assert not again.message.get("tool_calls")


def test_write_job_applies_decisions_within_constraints():
    chosen = {"base_model": "b", "dataset_size": 512, "level_mix": "task+harder", "rubric": "exact+format",
              "prompt_suffix": "tags", "steps": 8, "learning_rate": 1e-3, "group_size": 4}
    files = write_job(task(), chosen, seed=99)
    config = tomllib.loads(files["trainer.toml"])
    assert config == {"base_model": "b", "steps": 8, "learning_rate": 1e-3, "group_size": 4}
    assert "SEED = 99" in files["dataset.py"] and "ITEMS_PER_LEVEL = {1: 150, 2: 150}" in files["dataset.py"]
    assert "from aitrainsai_family_calc_chain.public import generate" in files["dataset.py"]
    assert "End your reply with <answer>" in files["dataset.py"]
    assert "answer_tag" in files["rubric.py"]
    assert files["environment.py"] == TEMPLATE["environment.py"]


def test_written_dataset_builds_the_chosen_rows(tmp_path, monkeypatch):
    """dataset.py is written from structure, and runs: the chosen seed, levels, sizes and question suffix."""
    (tmp_path / "fake_family.py").write_text(
        "from types import SimpleNamespace\n\n"
        "def generate(seed, level, count):\n"
        "    return [SimpleNamespace(question=f'q{seed}-{level}-{i}', answer=str(i), world={})\n"
        "            for i in range(count)]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    chosen = {"base_model": "a", "dataset_size": 32, "level_mix": "task+harder", "rubric": "exact",
              "prompt_suffix": "tools", "steps": 2}
    source = write_job(task().model_copy(update={"family_module": "fake_family"}), chosen, seed=7)["dataset.py"]
    namespace = {}
    exec(compile(source, "dataset.py", "exec"), namespace)
    rows = namespace["build"]()
    assert len(rows) == 32 and rows[0]["question"] == "q8-1-0 Use the tools, then answer."
    assert rows[-1]["question"].startswith("q9-2-15")
    half = write_job(task().model_copy(update={"family_module": "fake_family"}),
                     {**chosen, "prompt_suffix": "tags-half"}, seed=7)["dataset.py"]
    namespace = {}
    exec(compile(half, "dataset.py", "exec"), namespace)
    rows = [r["question"] for r in namespace["build"]()]
    assert [r.endswith("</answer>.") for r in rows[:4]] == [True, False, True, False]
    assert sum(r.endswith("</answer>.") for r in rows) == 16


def test_without_the_family_module_the_template_dataset_stays_and_is_not_a_decision(tmp_path):
    policy = RecipePolicy(RecipePolicy.Config(seed=1), state_dir=tmp_path)
    bare = task().model_copy(update={"family_module": ""})
    assert not {"dataset_size", "level_mix", "prompt_suffix"} & set(policy.decisions(bare))
    turn = sample(policy, bare)
    assert not [c for c in turn.message["tool_calls"] if '"dataset.py"' in c["function"]["arguments"]]
    assert job_of(tmp_path / "ws", bare, turn)["dataset.py"] == TEMPLATE["dataset.py"]


@pytest.mark.parametrize("kind", list(RUBRICS))
def test_every_rubric_source_compiles(kind):
    compile(rubric_source(kind), "rubric.py", "exec")


def test_training_moves_probability_to_what_is_rewarded(tmp_path):
    policy = RecipePolicy(RecipePolicy.Config(seed=0, learning_rate=0.3), state_dir=tmp_path)
    for _ in range(15):
        groups = []
        for _ in range(3):
            group = []
            for _ in range(4):
                turn = sample(policy)
                reward = 1.0 if turn.meta["chosen"]["rubric"] == "exact" else 0.0
                group.append(ScoredEpisode(id=f"e{len(group)}", turns=[turn], reward=reward))
            groups.append(group)
        asyncio.run(policy.update(groups))
    exact = list(RUBRICS).index("exact")
    after = policy.probabilities("calc_chain")
    assert after["rubric"][exact] > 1 / len(RUBRICS) + 0.3
    assert policy.policy_version > 0


def test_update_uses_importance_ratios_for_stale_samples(tmp_path):
    policy = RecipePolicy(RecipePolicy.Config(seed=1), state_dir=tmp_path)
    turns = [sample(policy) for _ in range(4)]
    group = [ScoredEpisode(id=f"e{i}", turns=[t], reward=float(i % 2)) for i, t in enumerate(turns)]
    first = asyncio.run(policy.update([group]))
    assert first["mean_ratio"] == pytest.approx(1.0)  # on policy
    second = asyncio.run(policy.update([group]))  # the same samples, now one update old
    assert second["mean_ratio"] != pytest.approx(1.0)
    assert math.isfinite(second["loss"])


def test_groups_without_signal_are_skipped(tmp_path):
    policy = RecipePolicy(RecipePolicy.Config(), state_dir=tmp_path)
    group = [ScoredEpisode(id=f"e{i}", turns=[sample(policy)], reward=0.5) for i in range(4)]
    assert asyncio.run(policy.update([group])) == {"groups_used": 0.0}
    assert policy.policy_version == 0


def test_held_out_families_use_the_shared_logits_only(tmp_path):
    policy = RecipePolicy(RecipePolicy.Config(), state_dir=tmp_path)
    turn = sample(policy, task("triage", held_out=True))
    assert turn.meta["family"] == ""


def test_a_refused_job_teaches_more_than_timing_jitter(tmp_path):
    def rubric_logits_moved(rewards):
        policy = RecipePolicy(RecipePolicy.Config(seed=2), state_dir=tmp_path)
        group = [ScoredEpisode(id=f"e{i}", turns=[sample(policy)], reward=r) for i, r in enumerate(rewards)]
        asyncio.run(policy.update([group]))
        return max(abs(x) for x in policy.shared["rubric"])

    jitter = rubric_logits_moved([0.620, 0.621, 0.622, 0.623])
    refused = rubric_logits_moved([0.62, 0.62, 0.0, 0.62])
    assert 0 < jitter < 0.01
    assert refused > 0.3


def test_step_options_run_up_to_the_task_budget(tmp_path):
    """No option the probe would refuse: every step count is within the budget, the budget itself included."""
    policy = RecipePolicy(RecipePolicy.Config(), state_dir=tmp_path)
    assert policy.decisions(task())["steps"] == [1, 2, 5, 10]
    assert policy.decisions(task().model_copy(update={"max_train_steps": 16}))["steps"] == [2, 4, 8, 16]
    assert policy.decisions(task().model_copy(update={"max_train_steps": 1}))["steps"] == [1]


def test_eval_episodes_with_a_seed_draw_the_same_job_from_the_same_policy(tmp_path):
    """Two evaluations of one policy on the same eval seeds write the same jobs, whatever the training stream did in
    between; different seeds draw differently; the training stream is left alone."""
    policy = RecipePolicy(RecipePolicy.Config(seed=5), state_dir=tmp_path)
    messages = [{"role": "user", "content": "go"}]

    def evaluate(seed):
        return asyncio.run(policy.sample(messages, [], task().model_copy(update={"eval_seed": seed}), mode="eval"))

    first = [evaluate(seed).message for seed in range(6)]
    state = policy.rng.getstate()
    sample(policy)  # a training draw in between
    assert [evaluate(seed).message for seed in range(6)] == first
    assert len({json.dumps(m) for m in first}) > 1
    policy.rng.setstate(state)
    evaluate(0)
    assert policy.rng.getstate() == state


def test_the_shaped_rubric_gives_partial_credit_before_the_answer_is_right(tmp_path, monkeypatch):
    from types import SimpleNamespace

    class Parser:
        def parse_answer(self, completion):
            return completion[-1].content.split("<answer>")[-1].split("</answer>")[0]

    namespace = {}
    monkeypatch.setitem(__import__("sys").modules, "verifiers", SimpleNamespace(
        Rubric=lambda funcs, weights, parser: (funcs, weights)))
    exec(compile(rubric_source("shaped"), "rubric.py", "exec"), namespace)
    funcs, weights = namespace["build_rubric"](Parser())

    def score(text, answer="42"):
        reply = [SimpleNamespace(role="assistant", content=text)]
        return round(sum(w * f(completion=reply, answer=answer, parser=Parser()) for f, w in zip(funcs, weights)), 3)

    assert score("<answer>42</answer>") == 1.6
    assert score("It is 42, I think.") == 0.4  # named, short, untagged, wrong format
    assert score("<answer>41</answer>") == 0.3
    assert score("x" * 200) == 0.0
    # the answer read as the hidden eval reads it: case, quotes and a final period ignored, untagged last line
    assert score("<answer>'oslo.'</answer>", answer="Oslo") == 1.6
    assert score("Looked it up.\nOslo", answer="Oslo") == 1.4


@pytest.mark.parametrize("kind", list(RUBRICS))
def test_each_v1_rubric_scores_every_rollout_as_its_classic_rubric_does(kind, monkeypatch):
    """The v1 rubric reads the reply the hidden eval reads (the last assistant message with text), as the classic one
    does: a reply that gives the answer and then calls a tool (the turn limit ends the rollout on the call) keeps its
    answer. Both run on stand-ins of verifiers' API: this holds the sources' reading of a rollout, not verifiers."""
    from types import SimpleNamespace as N

    from aitrainsai_outer_recipe.policy import rubric_source_v1

    def weighted(weight):
        def mark(function):
            function.weight = weight
            return function
        return mark

    stand_in = N(reward=weighted, Trace=object)
    monkeypatch.setitem(__import__("sys").modules, "verifiers", N(
        Rubric=lambda funcs, weights, parser: list(zip(funcs, weights)), v1=stand_in))
    monkeypatch.setitem(__import__("sys").modules, "verifiers.v1", stand_in)
    classic: dict = {}
    exec(compile(rubric_source(kind), "rubric.py", "exec"), classic)
    v1: dict = {}
    exec(compile(rubric_source_v1(kind), "rubric.py", "exec"), v1)
    terms = [getattr(v1["Rubric"], name) for name, value in vars(v1["Rubric"]).items() if hasattr(value, "weight")]

    call = N(id="c0", type="function", function=N(name="lookup", arguments="{}"))
    rollouts = {
        "tagged": [N(role="assistant", content="It is Oslo. <answer>Oslo</answer>", tool_calls=None)],
        "wrong": [N(role="assistant", content="<answer>Rome</answer>", tool_calls=None)],
        "untagged last line": [N(role="assistant", content="Looked it up.\nOslo", tool_calls=None)],
        "answer, then a final call": [N(role="assistant", content="<answer>Oslo</answer>", tool_calls=[call]),
                                      N(role="tool", content="unknown", tool_calls=None),
                                      N(role="assistant", content="", tool_calls=[call])],
        "a call, then the answer": [N(role="assistant", content="", tool_calls=[call]),
                                    N(role="tool", content="Oslo", tool_calls=None),
                                    N(role="assistant", content="<answer>oslo.</answer>", tool_calls=None)],
        "calls only": [N(role="assistant", content=None, tool_calls=[call])],
    }
    for name, completion in rollouts.items():
        expected = sum(w * f(completion=completion, answer="Oslo", parser=None)
                       for f, w in classic["build_rubric"](None))
        trace = N(assistant_messages=[m for m in completion if m.role == "assistant"],
                  tool_messages=[m for m in completion if m.role == "tool"], last_message=completion[-1])
        task = N(data=N(answer="Oslo"))
        got = sum(f.weight * asyncio.run(f(task, trace)) for f in terms)
        assert got == pytest.approx(expected), (kind, name)


def test_eval_mode_draws_the_same_way_and_records_nothing_to_learn(tmp_path):
    trained = RecipePolicy(RecipePolicy.Config(seed=5), state_dir=tmp_path / "a")
    evaluated = RecipePolicy(RecipePolicy.Config(seed=5), state_dir=tmp_path / "b")
    messages = [{"role": "user", "content": "go"}]
    turn = asyncio.run(trained.sample(messages, [], task()))
    quiet = asyncio.run(evaluated.sample(messages, [], task(), mode="eval"))
    assert quiet.message == turn.message  # the same decisions, the same random stream
    assert quiet.completion_tokens == [] and quiet.logprobs == []
    assert asyncio.run(evaluated.update([[ScoredEpisode(id="a", turns=[quiet], reward=1.0),
                                          ScoredEpisode(id="b", turns=[quiet], reward=0.0)]])) == {"groups_used": 0.0}


def test_choices_replace_options_and_fix_template_keys(tmp_path):
    template = {**TEMPLATE, "trainer.toml": TEMPLATE["trainer.toml"] + "max_new_tokens = 48\n"}
    t = task().model_copy(update={"template": template})
    config = RecipePolicy.Config(choices={"steps": [1], "rubric": ["exact", "exact+tools"], "max_new_tokens": [8],
                                          "not_in_template": [3]})
    policy = RecipePolicy(config, state_dir=tmp_path)
    space = policy.decisions(t)
    assert space["steps"] == [1] and space["rubric"] == ["exact", "exact+tools"] and space["max_new_tokens"] == [8]
    assert "not_in_template" not in space
    for k in range(5):
        turn = asyncio.run(policy.sample([{"role": "user", "content": "go"}], [], t))
        written = tomllib.loads(job_of(tmp_path / f"ws{k}", t, turn)["trainer.toml"])
        assert written["steps"] == 1 and written["max_new_tokens"] == 8 and "rubric" not in written
        assert turn.meta["chosen"]["rubric"] in ("exact", "exact+tools")


@pytest.mark.parametrize("choices, message", [
    ({"steps": []}, "choices.steps is empty"),
    ({"rubric": ["exact", "magic"]}, "['magic'] are not among"),
    ({"steps": [0]}, "positive integers"),
    ({"group_size": [4, 4]}, "repeats an option"),
])
def test_bad_choices_are_refused_with_one_line(choices, message):
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=message.replace("[", r"\[").replace("]", r"\]")):
        RecipePolicy.Config(choices=choices)


def test_a_fixed_dataset_seed_gives_every_job_the_same_rows_and_leaves_the_draws_alone(tmp_path):
    """With ``dataset_seed`` every job's dataset.py draws from it, so jobs differ only in their decisions; the
    decisions are drawn as without it. Unset, each job draws its own seed."""
    free = RecipePolicy(RecipePolicy.Config(seed=4), state_dir=tmp_path / "a")
    fixed = RecipePolicy(RecipePolicy.Config(seed=4, dataset_seed=777), state_dir=tmp_path / "b")
    free_turns, fixed_turns = [sample(free) for _ in range(6)], [sample(fixed) for _ in range(6)]

    def seeds(name, turns) -> set[str]:
        sources = [job_of(tmp_path / f"{name}{k}", task(), t)["dataset.py"] for k, t in enumerate(turns)]
        return {next(line for line in s.splitlines() if line.startswith("SEED = ")) for s in sources}

    assert seeds("fixed", fixed_turns) == {"SEED = 777"}
    assert len(seeds("free", free_turns)) == 6
    assert [t.meta["chosen"] for t in fixed_turns] == [t.meta["chosen"] for t in free_turns]
    with pytest.raises(ValueError):
        RecipePolicy.Config(dataset_seed=-1)


# -- the turn as edits an LLM can imitate ----------------------------------------------------------------------------
REAL_FAMILIES = {"calc_chain": "CalcChainFamily", "multi_hop": "MultiHopFamily"}


def real_task(name: str) -> AgentTask:
    """The task an episode of the real family poses, with the job template its workspace starts with."""
    from aitrainsai import Constraints, job_template

    family = getattr(pytest.importorskip(f"aitrainsai_family_{name}.family"), REAL_FAMILIES[name])()
    local = pytest.importorskip("aitrainsai_trainer_local.inner").LocalTrainer
    trainer = local(local.Config())
    spec = family.task_spec(family.default_level, trainer.constraints(Constraints()))
    c = spec.constraints
    return AgentTask(family=name, level=spec.level, levels=list(family.levels), held_out=family.held_out,
                     template=job_template(spec, trainer.config_template(spec)),
                     family_module=spec.public_modules[0], allowed_bases=list(c.allowed_bases),
                     max_train_steps=c.max_train_steps, max_dataset_size=c.max_dataset_size)


@pytest.mark.parametrize("family", list(REAL_FAMILIES))
def test_the_turn_edits_the_real_template_into_write_jobs_job(tmp_path, family):
    """On the real template every changed file is edited, never written whole, and environment.py is left alone;
    the calls, made through the workspace tools, give write_job's files to the byte (so the same parsed
    trainer.toml, dataset rows and rubric), for every rubric and every question suffix."""
    t = real_task(family)
    suffixes = list(SUFFIXES)
    for k, rubric in enumerate(RUBRICS):
        choices = {"rubric": [rubric], "prompt_suffix": [suffixes[k % len(suffixes)]]}
        policy = RecipePolicy(RecipePolicy.Config(seed=k, dataset_seed=4321, choices=choices), state_dir=tmp_path)
        turn = sample(policy, t)
        calls = turn.message["tool_calls"]
        assert [c["function"]["name"] for c in calls] == ["edit_file"] * (len(calls) - 1) + ["submit_job"]
        assert not [c for c in calls if '"environment.py"' in c["function"]["arguments"]]
        expected = write_job(t, turn.meta["chosen"], seed=4321)
        assert job_of(tmp_path / f"ws{k}", t, turn) == expected
        edited = {json.loads(c["function"]["arguments"])["path"] for c in calls[:-1]}
        assert edited == {name for name in expected if expected[name] != t.template[name]}
        # no backslash in what is written: in a JSON call each doubles (\" in the code is \\\" in the call)
        assert not [c for c in calls if "\\" in "".join(map(str, json.loads(c["function"]["arguments"]).values()))]


def template_workspace(root, t) -> tuple[Workspace, dict]:
    """A workspace holding the task's template, and the file tools on it."""
    workspace = Workspace(root)
    for name, text in t.template.items():
        workspace.write_file(name, text)
    return workspace, {"read_file": workspace.read_file, "write_file": workspace.write_file,
                       "edit_file": workspace.edit_file}


def take_turn(policy, t, tools, messages):
    """One turn of ``policy``, its calls answered by ``tools`` (submit_job: "accepted"), all appended to
    ``messages``."""
    turn = asyncio.run(policy.sample(list(messages), [], t))
    messages.append(turn.message)
    for call in turn.message.get("tool_calls") or []:
        name = call["function"]["name"]
        result = call_tool(tools, name, call["function"]["arguments"]) if name in tools else "accepted"
        messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
    return turn


def test_read_first_reads_every_file_it_edits_then_edits_them_and_submits(tmp_path):
    """With read_first the job takes two turns: read_file on the files write_job rewrites (the real workspace answers
    with their text), then the same edits as in one turn, each edit's old text a piece of a file read before; then it
    stops. The read turn draws nothing and records nothing to learn from."""
    t = real_task("multi_hop")
    config = RecipePolicy.Config(seed=5, dataset_seed=4321, read_first=True, choices={"rubric": ["shaped"]})
    policy = RecipePolicy(config, state_dir=tmp_path)
    workspace, tools = template_workspace(tmp_path / "ws", t)
    messages = [{"role": "user", "content": "go"}]
    reads, edits, done = [take_turn(policy, t, tools, messages) for _ in range(3)]
    assert [json.loads(c["function"]["arguments"])["path"] for c in reads.message["tool_calls"]] == [
        "dataset.py", "rubric.py", "trainer.toml"]
    assert not reads.completion_tokens and not reads.meta
    read_text = "".join(m["content"] for m in messages[2:5])
    assert all(t.template[name] in read_text for name in ("dataset.py", "rubric.py", "trainer.toml"))
    calls = edits.message["tool_calls"]
    assert calls[-1]["function"]["name"] == "submit_job" and len(edits.completion_tokens) == len(edits.logprobs) > 0
    for call in calls[:-1]:
        assert json.loads(call["function"]["arguments"])["old"] in read_text
    written = {path.name: path.read_text() for path in workspace.root.iterdir() if path.is_file()}
    assert written == write_job(t, edits.meta["chosen"], seed=4321)
    assert not done.message.get("tool_calls")


def test_one_call_per_turn_makes_the_same_job_a_call_at_a_time(tmp_path):
    """With one_call_per_turn each read_file, each edit and submit_job is a turn of its own, after the result of the
    one before; the decisions are drawn (and recorded to learn from) in the first edit's turn only, and the job
    written is the one the same draws write in one turn. Two episodes played side by side keep their own plans."""
    t = real_task("multi_hop")
    config = RecipePolicy.Config(seed=5, dataset_seed=4321, read_first=True, one_call_per_turn=True,
                                 choices={"rubric": ["shaped"]})
    policy = RecipePolicy(config, state_dir=tmp_path)
    episodes = [(*template_workspace(tmp_path / f"ws{k}", t), [{"role": "user", "content": "go"}], [])
                for k in range(2)]
    for _ in range(20):  # interleaved: one turn of each episode in turn
        for _workspace, tools, messages, turns in episodes:
            turns.append(take_turn(policy, t, tools, messages))
    for workspace, _tools, _messages, turns in episodes:
        calls = [turn.message.get("tool_calls") or [] for turn in turns]
        made = [c for c in calls if c]
        assert all(len(c) == 1 for c in made) and not any(calls[len(made):])
        names = [c[0]["function"]["name"] for c in made]
        assert names[:3] == ["read_file"] * 3 and names[-1] == "submit_job" and "edit_file" in names
        learned = [turn for turn in turns if turn.completion_tokens]
        assert len(learned) == 1 and learned[0].message["tool_calls"][0]["function"]["name"] == "edit_file"
        written = {path.name: path.read_text() for path in workspace.root.iterdir() if path.is_file()}
        assert written == write_job(t, learned[0].meta["chosen"], seed=4321)
    assert not policy._plans  # every plan made was used up


def test_slips_make_a_call_wrong_once_then_right_after_its_error(tmp_path):
    """With slips = 1 every call after the first edit is made wrong once (a misspelt tool name, an old text the file
    lacks, the edit just made made again, or an edit without its new text) and the workspace answers with an error;
    the next turn makes it right; the job written is the one the same draws write without slips."""
    t = real_task("multi_hop")
    config = RecipePolicy.Config(seed=3, dataset_seed=4321, read_first=True, one_call_per_turn=True, slips=1.0,
                                 choices={"rubric": ["shaped"], "learning_rate": [1e-3]})
    policy = RecipePolicy(config, state_dir=tmp_path)
    workspace, tools = template_workspace(tmp_path / "ws", t)
    schemas = [{"type": "function", "function": {"name": name}} for name in [*tools, "submit_job"]]
    messages, turns = [{"role": "user", "content": "go"}], []
    for _ in range(40):
        turn = asyncio.run(policy.sample(list(messages), schemas, t))
        turns.append(turn)
        messages.append(turn.message)
        for call in turn.message.get("tool_calls") or []:
            name = call["function"]["name"]
            result = "accepted" if name == "submit_job" else call_tool(tools, name, call["function"]["arguments"])
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
    made = [(turn.message["tool_calls"][0], messages[i + 1]["content"])
            for i, turn in ((messages.index(turn.message), turn) for turn in turns) if turn.message.get("tool_calls")]
    first_edit = next(k for k, (c, _) in enumerate(made) if c["function"]["name"] == "edit_file")
    later = made[first_edit + 1:]
    assert len(later) >= 4 and len(later) % 2 == 0
    kinds = set()
    for k, ((wrong, error), (right, result)) in enumerate(zip(later[::2], later[1::2])):
        assert error.startswith("error: ") and not result.startswith("error: ")
        assert right["id"] + "s" == wrong["id"]
        before = (made[first_edit] if k == 0 else later[2 * k - 1])[0]  # the call made right before the slip
        if wrong["function"] == before["function"] and wrong["function"] != right["function"]:
            kinds.add("repeat")
            assert "this edit is made; go on" in error
        elif wrong["function"]["name"] != right["function"]["name"]:
            kinds.add("name")
        elif "new" not in json.loads(wrong["function"]["arguments"]):
            kinds.add("new")
            assert "new" in json.loads(right["function"]["arguments"])
            assert "missing argument(s) 'new'; expected path, old, new" in error
        else:
            kinds.add("old")
    assert kinds == {"name", "old", "repeat", "new"}
    assert later[-1][0]["function"]["name"] == "submit_job"
    (learned,) = [turn for turn in turns if turn.completion_tokens]
    written = {path.name: path.read_text() for path in workspace.root.iterdir() if path.is_file()}
    assert written == write_job(t, learned.meta["chosen"], seed=4321)
    assert not policy._plans and not policy._slipped


def test_trainer_toml_is_edited_one_line_a_key(tmp_path):
    """A changed key is one short edit of its own line: the pattern ``key = old`` -> ``key = new``."""
    t = real_task("calc_chain")
    policy = RecipePolicy(RecipePolicy.Config(seed=1, choices={"learning_rate": [1e-3], "group_size": [4]}),
                          state_dir=tmp_path)
    turn = sample(policy, t)
    edits = [json.loads(c["function"]["arguments"]) for c in turn.message["tool_calls"]
             if '"trainer.toml"' in c["function"]["arguments"]]
    assert {"path": "trainer.toml", "old": "learning_rate = 0.0002", "new": "learning_rate = 0.001"} in edits
    assert {"path": "trainer.toml", "old": "group_size = 8", "new": "group_size = 4"} in edits
    assert all("\n" not in e["old"] and e["old"].split(" = ")[0] == e["new"].split(" = ")[0] for e in edits)


def test_the_turn_round_trips_through_the_hermes_tool_call_format(tmp_path):
    """Rendered as a model writes it (Hermes <tool_call> blocks) and parsed back, the turn has the same calls, with
    the same arguments, and the same plan text."""
    t = real_task("multi_hop")
    for seed in range(3):
        message = sample(RecipePolicy(RecipePolicy.Config(seed=seed), state_dir=tmp_path), t).message
        ((role, text),) = ChatML().turns([message])
        parsed = parse_reply(text)
        assert role == "assistant" and parsed.error is None
        assert parsed.content.rstrip("\n") == message["content"]
        assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [
            (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]]


@pytest.mark.parametrize("before, after", [
    ("a = 1\nsteps = 4\nmax_steps = 4\n", "a = 1\nsteps = 2\nmax_steps = 4\n"),  # "steps = 4" twice: widened
    ("x = 1\ny = 2\nx = 1\n", "x = 1\ny = 2\nx = 3\n"),  # the repeated line: widened backwards
    ("a\n\nb\n", "A\n\nB\n"),  # runs apart by a blank line: one edit
    ("a\nb\n", "a\nb\nc\n"),  # an insertion at the end: anchored on the line before
    ("a\nb\n", "c\na\nb\n"),  # and at the start: on the line after
    ("a\nb\nc\n", "a\nc\n"),  # a deletion
])
def test_line_edits_make_the_target_through_the_workspace(tmp_path, before, after):
    edits = line_edits(before, after)
    assert edits is not None
    calls = [{"function": {"name": "edit_file", "arguments": json.dumps({"path": "f", "old": e.old, "new": e.new})}}
             for e in edits]
    assert apply_calls(tmp_path, {"f": before}, calls) == {"f": after}


def test_line_edits_give_way_to_a_whole_write_where_nothing_stays(tmp_path):
    assert line_edits("# rubric\n", "import x\n") is None
    assert line_edits("a\na\n", "a\na\na\nb\n") is None  # no part of the file but all of it occurs once
    assert line_edits("a\nb\na\n", "a\nb\na\nc\n") == [("b\na", "b\na\nc")]
    assert line_edits("", "a\n") is None


def test_line_edits_on_random_texts_always_make_the_target(tmp_path):
    """Texts of a few repeated lines (so that old texts often recur): either edits that give the target through
    the real workspace, or None (a whole write), never wrong edits."""
    import random

    rng = random.Random(0)
    alphabet = ["x = 1\n", "y = 2\n", "\n", "def f():\n", "    return 1\n"]
    made = 0
    for k in range(400):
        before = "".join(rng.choices(alphabet, k=rng.randint(1, 8)))
        lines = before.splitlines(keepends=True)
        for _ in range(rng.randint(1, 3)):
            at = rng.randrange(len(lines) + 1)
            change = rng.choice(["insert", "pop", "replace"])
            if change == "insert":
                lines.insert(at, rng.choice(alphabet + ["z = 3\n"]))
            elif change == "pop":
                if len(lines) > 1:
                    lines.pop(min(at, len(lines) - 1))
            else:
                lines[min(at, len(lines) - 1)] = "w = 4\n"
        after = "".join(lines)
        edits = line_edits(before, after)
        if edits is None or before == after:
            continue
        calls = [{"function": {"name": "edit_file",
                               "arguments": json.dumps({"path": "f", "old": e.old, "new": e.new})}} for e in edits]
        assert apply_calls(tmp_path / str(k), {"f": before}, calls) == {"f": after}, (before, after)
        made += 1
    assert made > 250
