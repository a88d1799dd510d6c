"""The environment a trainer process loads (prime-rl's orchestrator) when the job's code must stay in the sandbox:
rows, tool results and rewards come from the sandbox, and the job's code never runs in the loading process."""

import asyncio
import os

import pytest
from aitrainsai.jobs.job import job_template, write_frozen_rows
from aitrainsai.plugins import Plugins

vf = pytest.importorskip("verifiers")


@pytest.fixture(scope="module")
def family():
    registry = Plugins.load().task_families
    if "calc_chain" not in registry:
        pytest.skip("needs the calc_chain family installed (the whole workspace)")
    return registry.create("calc_chain")


def frozen(folder, family, marker: str):
    spec = family.task_spec()
    folder.mkdir(parents=True)
    for name, text in job_template(spec, "steps = 1\n").items():
        (folder / name).write_text(text)
    environment = folder / "environment.py"  # agent code that leaves a trace where it runs
    environment.write_text(f"import os\nos.environ[{marker!r}] = 'ran here'\n" + environment.read_text())
    items = family.dev_examples(n=3)
    write_frozen_rows(folder, [{"question": i.question, "answer": i.answer, "world": i.world} for i in items],
                      spec.eval_interface.system_prompt)
    return items


def test_rows_tools_and_rewards_come_from_the_sandbox(tmp_path, family):
    from aitrainsai.jobs.sandboxed_env import ROLLOUT, SandboxedEnv
    from verifiers.types import AssistantMessage, ToolCall

    marker = "AITRAINSAI_TEST_AGENT_CODE"
    items = frozen(tmp_path / "job", family, marker)
    env = SandboxedEnv(tmp_path / "job")
    try:
        assert marker not in os.environ, "the job's code ran in the loading process"
        assert len(env.dataset) == 3 and env.max_turns == family.turn_limit
        assert env.dataset[0]["prompt"] == family.initial_messages(items[0])
        assert [t.name for t in env.tool_defs] == [s["function"]["name"] for s in family.tool_schemas()]
        reference = family.reference_transcript(items[0])
        call = reference[2]["tool_calls"][0]

        async def started():
            state = vf.State(prompt=env.dataset[0]["prompt"], answer="", info=env.dataset[0]["info"], task="job",
                             example_id=0, trajectory=[], timing={})
            return await env.setup_state(state)

        async def rollout():
            state = await started()
            asked = AssistantMessage(content="", tool_calls=[ToolCall(id="c1", name=call["function"]["name"],
                                                                      arguments=call["function"]["arguments"])])
            replies = await env.env_response([asked], state)
            right = await env.job_reward([AssistantMessage(content=reference[-1]["content"])], state)
            wrong = await env.job_reward([AssistantMessage(content="<answer>-1</answer>")], await started())
            return state, replies, right, wrong

        state, replies, right, wrong = asyncio.run(rollout())
        assert isinstance(state[ROLLOUT], int)
        assert [(r.tool_call_id, r.content) for r in replies] == [("c1", reference[3]["content"])]
        assert (right, wrong) == (1.0, 0.0)
    finally:
        env.close()


@pytest.mark.parametrize("probe_reward, dies", [(1.0, False), (0.25, True)])
def test_the_rubric_scores_the_probes_samples_again_before_any_rollout(tmp_path, family, probe_reward, dies):
    """prime-rl's path, as the local trainer's: a rubric that scored the probe's samples otherwise than it scores them
    now (one that tells the probe from training) is refused before the first rollout, naming the sample."""
    from aitrainsai.jobs.job import ProbeSample, frozen_rows
    from aitrainsai.jobs.remote_env import RubricChanged
    from aitrainsai.jobs.sandboxed_env import SandboxedEnv

    items = frozen(tmp_path / "job", family, "AITRAINSAI_TEST_SAMPLES")
    reference = family.reference_transcript(items[0])
    sample = ProbeSample(label="a dev example's reference transcript",
                         row_data=frozen_rows(tmp_path / "job").row_data(0), completion=reference[2:],
                         reward=probe_reward)
    write_frozen_rows(tmp_path / "job", [{"question": i.question, "answer": i.answer, "world": i.world}
                                         for i in items], family.task_spec().eval_interface.system_prompt,
                      samples=[sample])
    if not dies:
        SandboxedEnv(tmp_path / "job").close()
        return
    with pytest.raises(RubricChanged, match="the rubric scored a dev example's reference transcript 0.25 in the probe "
                                            "and 1 in training"):
        SandboxedEnv(tmp_path / "job")
