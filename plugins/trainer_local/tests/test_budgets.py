"""A job's budgets are work and the job's own code, not the machine's seconds: the wall clock is a net scaled to the
machine, and what trips it is the infrastructure's; a replay tells a reproducible job's code from one that is not."""

import json

import pytest

from aitrainsai import Constraints, FrozenRows, JobResult
from aitrainsai_trainer_local.config import LocalJobConfig
from aitrainsai_trainer_local.inner import EXIT_INFRA, LocalTrainer
from aitrainsai_trainer_local.job import Call, Clock, MachineTooSlow, TrainingFailed, replay_calls


class Clocks:
    """Wall time a test moves by hand."""

    def __init__(self):
        self.now = 0.0

    def wall(self) -> float:
        return self.now


@pytest.fixture
def clocks():
    return Clocks()


def clock(budget, clocks, *, stretch=1.0):
    return Clock(budget, wall=clocks.wall, stretch=lambda: stretch, load=lambda: stretch)


def test_a_loaded_machine_stretches_wall_time_but_never_the_work(clocks):
    """A load of about 9 on 2 cores stretches the trainer's steps (45 s of wall each, 540 s against a budget of
    100); their counted work stays the reference's 10 s each, and nothing fires."""
    net = clock(100.0, clocks)
    for step in range(1, 13):
        clocks.now += 45.0
        net.after_step(step, 12, seconds=45.0, work=10.0)
    assert net.work_s() == pytest.approx(120.0) and net.speed == pytest.approx(10 / 45)


def test_a_neighbours_load_changes_no_jobs_work_nor_its_verdict(clocks):
    """Review ten: a neighbour's load that began after the machine's speed was measured counted as the job's work
    (6.6 times at 2 threads), and an honest job could die of it. Work is counted from what the trainer computed: the
    same steps on a quiet machine and under a load that stretches them 6.6 times come to the same work, and the same
    verdict."""
    verdicts = []
    for seconds in (10.0, 66.0):
        clocks.now = 0.0
        net = clock(100.0, clocks)
        for step in range(1, 9):
            clocks.now += seconds
            net.after_step(step, 8, seconds=seconds, work=12.0)
        verdicts.append(net.work_s())
    assert verdicts == [96.0, 96.0]


def test_a_machine_too_slow_for_work_within_its_budget_is_the_infrastructure(clocks):
    """A machine (with its load) at a fifth of the reference's speed: a job doing 1.2 budgets of the reference's work
    needs 6 budgets of wall time here, and is not the job's fault; past 6 budgets of wall time it is stopped, as the
    machine's."""
    net = clock(100.0, clocks)
    for step in range(1, 3):
        clocks.now += 250.0
        net.after_step(step, 3, seconds=250.0, work=50.0)  # within 1.5 budgets
    clocks.now += 101.0
    with pytest.raises(MachineTooSlow, match=r"step 3 of 3: the trainer took 601 s of wall time, over 6 times .* "
                                             r"\(120 s of the reference machine's compute; besides, 0 s in the job's "
                                             r"code\): the machine, not the job"):
        net.after_step(3, 3, seconds=101.0, work=20.0)


@pytest.mark.parametrize("seconds", [16.0, 160.0, 1_000.0])
def test_work_over_its_budget_is_the_jobs_fault_on_any_machine(clocks, seconds):
    """Review four's job: prompts of 4,000 filler words made its steps ten times longer (at 7 positions a sampled
    token, under the old per-token bound), and the net called the machine slow. Its work is counted, whatever made
    it: 1.6 budgets of it are the job's doing, on a machine ten times the reference's speed, at it, or at a sixth."""
    net = clock(100.0, clocks)
    clocks.now = seconds
    with pytest.raises(TrainingFailed, match=r"step 1 of 2: its work came to 160 s of the reference machine's "
                                             r"compute, over 1.5 times the budget of 100 s: the job's doing"):
        net.after_step(1, 2, seconds=seconds, work=160.0)


@pytest.mark.parametrize("speed", [0.26, 0.4, 1.0, 2.6])
@pytest.mark.parametrize("step_s", [0.5, 7.0, 60.0])
def test_whatever_a_step_does_the_job_is_out_of_work_before_the_machine_looks_slow(clocks, speed, step_s):
    """Review seven: work undercounted single-threaded time in a step (a thousand tiny decode steps, tool results) by
    3.5 to 10 times, and a job that made its steps so reached the machine's net: exit 75, infrastructure. Whatever a
    step spends its time on, a job's work passes 1.5 budgets before its time passes 6, on any machine that runs the
    counted work at over a quarter of the reference's speed (load included)."""
    net = clock(100.0, clocks)
    with pytest.raises(TrainingFailed, match="the job's doing"):
        for step in range(1, 100_000):
            clocks.now += step_s
            net.after_step(step, 100_000, seconds=step_s, work=step_s * speed)
    assert net.trainer_s <= 100.0 * 6


class Sandbox:
    """The CPU seconds a job's sandbox has used, moved by hand (None: not counted)."""

    def __init__(self):
        self.used: float | None = 0.0

    def __call__(self):
        return self.used


def test_a_sandbox_that_burns_cpu_between_calls_spends_the_jobs_budget(clocks):
    """Review seven's burner: a process the job's code leaves running between calls takes the CPU from the trainer
    (and can slow the machine's measure) while no call is timed. The sandbox's CPU time between calls is the job's
    time: over its budget, the job dies, its doing."""
    net = clock(60.0, clocks)
    sandbox = Sandbox()
    net.watch(sandbox)
    net.mark()

    def tool(cpu):  # a call: its wall time counts, and the CPU its sandbox used in it is not counted again
        clocks.now += 1.0
        sandbox.used += cpu
        return "ok"

    for step in range(1, 4):
        net.job_code(tool, 0.9)
        sandbox.used += 15.0  # between calls, in the step
        clocks.now += 15.0
        net.after_step(step, 12, seconds=16.0, work=1.0)
    assert net.idle_cpu_s == 45.0 and net.job_s == 3.0
    sandbox.used += 15.0
    with pytest.raises(TrainingFailed, match=r"took 64 s in all \(60 s of it its sandbox's CPU time between calls\), "
                                             r"over its budget of 60 s"):
        net.job_code(tool, 0.0)


def test_a_measure_the_jobs_sandbox_burned_through_is_not_kept(clocks):
    """Review eight's burner: the job's code spins right after each step's last call, while the trainer measures the
    machine's load, which would stretch the job's own budgets. A measure during which the sandbox used the CPU is
    taken again, and never kept: the stretch stays the quiet one, and the burning is the job's time."""
    sandbox = Sandbox()
    plan = iter([(0.0, 1.0), (0.5, 3.8), (0.5, 3.8), (0.5, 3.8), (0.5, 3.8), (0.0, 1.1)])

    def measure():  # the sandbox's CPU during each measure, and the stretch it would give
        burned, stretch = next(plan)
        sandbox.used += burned
        return stretch

    net = Clock(60.0, wall=clocks.wall, load=measure)
    net.calibrate()  # before the sandbox starts
    net.watch(sandbox)
    net.calibrate()  # three tries, all burned through: none kept
    assert net.measures == [1.0] and net.busy_measures == 3
    net.calibrate()  # one burned through, then a quiet one
    assert net.measures == [1.0, 1.1] and net.busy_measures == 4
    net.job_code(lambda: None)
    assert net.idle_cpu_s == 2.0  # the burning is the job's time


def test_an_idle_sandbox_and_one_that_is_not_counted_cost_the_job_nothing(clocks):
    net = clock(60.0, clocks)
    sandbox = Sandbox()
    sandbox.used = 2.0  # its start: before it was watched
    net.watch(sandbox)
    for _ in range(50):
        net.job_code(lambda: setattr(sandbox, "used", sandbox.used + 1.0))  # busy in its calls alone
    assert net.idle_cpu_s == 0.0
    sandbox.used = None  # closed, or no CPU cgroup here
    net.job_code(lambda: None)
    assert net.idle_cpu_s == 0.0


def test_the_jobs_own_time_never_makes_the_machine_look_slow(clocks):
    """Review five's job: hundreds of processes stuck in vfork raised the load average to 25 on 2 cores (so every
    allowance stretched 8 times), then its environment slept 420 s while it loaded, outside any budget, and the net
    called the machine slow after one step. Loading is the job's time now, the stretch is measured from the trainer's
    own work (waiting processes take no CPU), and the job's time never counts toward the machine's net."""
    net = clock(60.0, clocks, stretch=8.0)
    net.job_code(setattr, clocks, "now", clocks.now + 420.0)  # the environment's load: 420 s, within 8 x 60
    net.mark()
    clocks.now += 11.0
    net.after_step(1, 4, seconds=11.0, work=11.0)  # 431 s of wall, 11 of them the trainer's: nothing fires
    assert net.trainer_s == 11.0
    quiet = clock(60.0, clocks, stretch=1.0)
    with pytest.raises(TrainingFailed, match="took 420 s in all, over its budget of 60 s"):
        quiet.job_code(setattr, clocks, "now", clocks.now + 420.0)  # on a quiet machine: the job's fault


def test_waiting_on_the_sandbox_outside_the_steps_never_counts_as_the_machines(clocks):
    """Review six's job: its environment stalled 55 s on each page of rows it served while training checked them
    (outside the job's budget then), and the net took any wall time not in the job's code for the trainer's: 444 s,
    exit 75. Checking the rows is the job's time now, and the trainer's time is its steps' alone, less the job's
    code's in them."""
    net = clock(60.0, clocks)
    clocks.now += 444.0  # before the first step: not the trainer's
    net.mark()
    for step in (1, 2):
        clocks.now += 5.0
        net.job_code(setattr, clocks, "now", clocks.now + 20.0)  # a tool call inside the step
        net.after_step(step, 2, seconds=25.0, work=5.0)
    assert net.trainer_s == 10.0 and net.job_s == 40.0


def test_measuring_the_load_is_not_the_jobs_work(clocks):
    def measure():
        clocks.now += 30.0  # a measure that took 30 s
        return 1.0

    net = Clock(100.0, wall=clocks.wall, load=measure)
    net.calibrate()  # before the sandbox starts
    for step in range(1, 6):
        clocks.now += 20.0
        net.after_step(step, 5, seconds=20.0, work=20.0)  # 100 s of work, 150 s of measuring
    assert net.work_s() == 100.0 and net.trainer_s == 100.0 and len(net.measures) == 6


def test_the_loads_stretch_is_the_median_of_its_measures(clocks):
    measures = iter([1.0, 8.0, 1.2, 1.0, 1.1])
    net = Clock(100.0, wall=clocks.wall, load=lambda: next(measures))
    for _ in range(5):
        net.calibrate()
    assert net.stretch() == 1.1  # one slow moment moves nothing


def test_this_machines_load_is_measured_in_a_sane_range():
    import torch

    from aitrainsai_trainer_local.load import MAX_STRETCH, stretch

    assert 1.0 <= stretch(torch.float32, torch.device("cpu")) <= MAX_STRETCH


@pytest.mark.parametrize("compute", [1.04, 1.21])
def test_no_stall_of_the_jobs_code_makes_the_machine_look_slow(clocks, compute):
    """The reviews' rubrics: one that stalls (each call within its own budget, all within the job's) on a machine where
    the trainer needs a little more than its budget. The nets read the trainer's compute alone, so the stall neither
    turns the job into infrastructure (left out, no penalty) nor fires at all; the job's code answers to its own
    budget."""
    budget = 1_200.0
    for stall in (0.0, 0.49, 0.51, 0.9):
        clocks.now = 0.0
        net = clock(budget, clocks)
        for step in range(1, 13):
            clocks.now += compute * budget / 12
            net.job_code(setattr, clocks, "now", clocks.now + stall * budget / 12)
            net.after_step(step, 12, seconds=(compute + stall) * budget / 12,  # never the machine's, nor the job's
                           work=compute * budget / 12)
        assert net.trainer_s == pytest.approx(compute * budget)


def test_the_jobs_own_code_has_its_budget_and_a_budget_per_call(clocks):
    clock = Clock(100.0, wall=clocks.wall, stretch=lambda: 1.0, load=lambda: 1.0)
    assert clock.call_budget_s == 100.0 and Clock(1_200.0, stretch=lambda: 1.0).call_budget_s == 120.0

    def slow_call(seconds):
        clocks.now += seconds
        return "ok"

    assert clock.job_code(slow_call, 60.0) == "ok"

    def timed_out(seconds):
        clocks.now += seconds
        raise TimeoutError("score: the environment did not answer within 100 s")

    with pytest.raises(TimeoutError, match="did not answer"):  # a call's own failure is not hidden by the total
        clock.job_code(timed_out, 100.0)
    with pytest.raises(TrainingFailed, match="the job's code .* took 161 s in all, over its budget of 100 s"):
        clock.job_code(slow_call, 1.0)


def test_the_sandbox_has_the_budget_in_cpu_and_a_hard_wall_far_beyond_it():
    from aitrainsai_trainer_local.config import LocalTrainerConfig
    from aitrainsai_trainer_local.inner import HARD_WALL
    from aitrainsai_trainer_local.jobspec import TrainSpec

    spec = TrainSpec(family="calc_chain", level=1, job_dir="job", digest="0" * 64, constraints=Constraints(),
                     trainer=LocalTrainerConfig(), wall_s=600)
    limits = Clock(600.0).limits(spec)
    assert limits.cpu_s == 600 and limits.wall_s == 600 * HARD_WALL


@pytest.mark.parametrize("reason, code, infra", [
    ("failed", EXIT_INFRA, True), ("timeout", None, False), ("failed", 1, False), ("oom", None, False),
    ("lost", None, False)])
def test_a_dead_payload_is_the_infrastructures_only_by_the_drivers_own_exit(reason, code, infra):
    dead = JobResult.dead("j", reason, "why", exit_code=code)
    assert (LocalTrainer().classify(dead).reason == "infra") is infra
    done = JobResult(job_id="j", status="done")
    assert LocalTrainer().classify(done) == done


def test_the_probe_checks_the_work_a_job_asks_for(tmp_path):
    trainer = LocalTrainer(LocalTrainer.Config(max_train_steps=12, max_train_tokens=12 * 4 * 8 * 2 * 48))
    assert LocalTrainer.Config(max_train_steps=12).max_train_tokens == 12 * 8_192  # unset: per allowed step
    constraints = trainer.constraints(Constraints())
    assert constraints.max_train_tokens == 36_864
    within = 'steps = 12\nprompts_per_step = 4\ngroup_size = 8\nmax_turns = 2\nmax_new_tokens = 48\n'
    (tmp_path / "trainer.toml").write_text(within)
    assert trainer.check_config(tmp_path, constraints) == []
    for over in ("max_turns = 3", "max_new_tokens = 49", "group_size = 9"):
        key = over.split(" = ")[0]
        text = "\n".join(line for line in within.splitlines() if not line.startswith(key)) + f"\n{over}\n"
        (tmp_path / "trainer.toml").write_text(text)
        (problem,) = trainer.check_config(tmp_path, constraints)
        assert "over the training budget of 36864" in problem.message, problem
    assert LocalTrainer.train_tokens(LocalJobConfig()) == 12 * 4 * 8 * 2 * 48


@pytest.mark.parametrize("value, expected", [(True, True), (False, False), ("yes", None), ([True], None), (1, None)])
def test_train_json_says_how_much_work_and_whether_the_code_replayed_and_nothing_else(tmp_path, value, expected):
    steps = [{"tokens_generated": 100}, {"tokens_generated": 28}]
    (tmp_path / "train.json").write_text(json.dumps({"train_seconds": 9.0, "metrics": {"steps": steps},
                                                      "reproducible": value}))
    done = JobResult(job_id="j", status="done", artifacts={"train": tmp_path / "train.json", "checkpoint": tmp_path})
    outcome = LocalTrainer().result(done)
    assert outcome.reproducible is expected and outcome.work == 128.0
    (tmp_path / "train.json").write_text(json.dumps({"train_seconds": 9.0, "metrics": {"steps": [
        {"tokens_generated": "many"}]}}))
    assert LocalTrainer().result(done).work is None


class ReplayedEnv:
    """What a job's environment answers when its calls are replayed: ``tools`` and ``rewards`` in call order."""

    def __init__(self, tools: list[str], rewards: list[float]):
        self.tools, self.rewards = list(tools), list(rewards)
        self.started = 0

    def start(self, row_data):
        self.started += 1
        return 100 + self.started  # another state than training's

    def tool(self, state, name, arguments):
        assert state > 100
        return self.tools.pop(0)

    def score(self, state, completion):
        from types import SimpleNamespace

        return SimpleNamespace(reward=self.rewards.pop(0))


FROZEN = FrozenRows(system_prompt="s", rows=[{"question": "q", "answer": "1", "world": {}}])
ANSWERED = [{"role": "assistant", "content": "<answer>3</answer>"}]


def rollouts(count: int) -> list[Call]:
    """``count`` rollouts of row 0 as training made them: a start, a tool call that answered 3, a score of 0.5."""
    return [call for state in range(count) for call in (
        Call("start", state, 0, (), state), Call("tool", state, 0, ("add", "{}"), "3"),
        Call("score", state, 0, (ANSWERED,), 0.5))]


@pytest.mark.parametrize("tools, rewards, same, says", [
    (["3"] * 12, [0.5] * 12, True, "36 calls into the job's code (12 rollouts) replayed in their order"),
    (["3"] * 5 + ["4"] + ["3"] * 6, [0.5] * 12, False, "tool 'add' answered a rollout of row 0 differently"),
    (["3"] * 12, [0.5] * 7 + [0.5004] + [0.5] * 4, False, "the rubric scored a rollout of row 0 0.5, then 0.5004"),
])
def test_a_replay_tells_reproducible_code_from_code_that_is_not(tools, rewards, same, says):
    """Every call training made is made again, in its order: review nine's rubric drew noise on its 32nd to 35th
    calls alone (a middle step), which a replay of the first and last steps' rollouts never reached."""
    result = replay_calls(ReplayedEnv(tools, rewards), FROZEN, rollouts(12), Clock(100.0))
    assert result.same is same and says in result.detail, result


def test_a_loaded_machine_stretches_the_jobs_code_budgets_as_the_probes(clocks):
    """The review's honest job on a machine at load 12.8 on 2 cores: its code's calls took longer in wall time than
    on a quiet machine. Its budgets stretch with the load (at most 8 times), as the probe's do: not the job's fault."""
    load = {"stretch": 6.4}
    clock = Clock(20.0, wall=clocks.wall, stretch=lambda: load["stretch"])
    assert clock.call_budget_s == 20.0 * 6.4

    def call(seconds):
        clocks.now += seconds
        return "ok"

    assert clock.job_code(call, 22.0) == "ok"  # 22 s of a 20 s budget, at load 6.4
    load["stretch"] = 1.0
    with pytest.raises(TrainingFailed, match="took 23 s in all, over its budget of 20 s"):
        clock.job_code(call, 1.0)  # the same on a quiet machine: the job's
