"""What one agent episode costs on Tinker, from measured sizes: the opening prompt (task spec, reward text, job
template, tool schemas) and the turns of an agent that rewrites each template file and submits, rendered in each
chat format with each tokenizer (SmolLM2's; Qwen3's and Qwen3.5's real ones, embedded in tml-renderers, installed
apart in .venv/pinned/tinker-renderers by the Makefile), priced at the plugin's rate table. ``--view`` picks the task
view the agent opens with (``loop.task_view``); ``--openings`` prints instead, for every installed family, the
opening prompt's size in both views.

    .venv/bin/python plugins/outer_tinker/benchmarks/prompt_sizes.py [--family calc_chain] [--view full|compact]
    .venv/bin/python plugins/outer_tinker/benchmarks/prompt_sizes.py --openings
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def episode_of(family: str, runs: Path, view: str = "full", plugins=None):
    """An episode of ``family`` (level 1) in a run of the default config with ``loop.task_view=view``; no outer
    trainer is built (the sizes need none)."""
    from aitrainsai import Ledger, Plugins, Session, load_config, resolve

    plugins = plugins or Plugins.load()
    overrides = ["families.train=[]", "families.held_out=[]", f"loop.task_view={view}"]  # any family, held out too
    resolved = resolve(load_config(None, overrides, presets=plugins.presets), plugins, outer=False)
    run = Ledger(runs).create_run(resolved.snapshot(), [], name="sizes")
    return Session(resolved, plugins, run).episode(family, 1, "ep-1", step=0, group_id="g0")


def turns_of(episode) -> list[tuple[dict, dict]]:
    """(reply, tool result) per turn: write each template file as it is (a reply the size of a real rewrite), then
    submit_job."""
    out = []
    for k, (name, text) in enumerate(episode.template().items()):
        call = {"id": f"call_{k}", "type": "function",
                "function": {"name": "write_file", "arguments": json.dumps({"path": name, "content": text})}}
        out.append(({"role": "assistant", "content": f"I will improve {name}.", "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": f"call_{k}", "name": "write_file",
                     "content": f"wrote {name} ({len(text)} characters)"}))
    submit = {"id": "call_s", "type": "function", "function": {"name": "submit_job", "arguments": "{}"}}
    out.append(({"role": "assistant", "content": "Submitting.", "tool_calls": [submit]},
                {"role": "tool", "tool_call_id": "call_s", "name": "submit_job",
                 "content": "accepted: the job is queued for training"}))
    return out


def reply_text(renderer, reply) -> str:
    """The reply as the format writes it (what the sampler would produce)."""
    from aitrainsai import FunctionCall, format_tool_call
    from aitrainsai_outer_tinker import rendering

    call = FunctionCall.model_validate(reply["tool_calls"][0]["function"])
    if renderer.format == "qwen3_5":
        return reply["content"] + "\n\n" + rendering._format_call(call) + "<|im_end|>"
    return reply["content"] + "\n" + format_tool_call(call) + "<|im_end|>"


def measure(renderer, opening, tools, turns) -> dict[str, int]:
    """Prefill, sampled and trained tokens of the episode, rendered turn by turn as the trainer renders it: in the
    Hermes format the episode is one datum (each prompt extends the last), in Qwen3.5's one datum per turn."""
    messages, prefill, sampled, per_turn = list(opening), 0, 0, 0
    prompt: list[int] = []
    for reply, result in turns:
        prompt = renderer.prompt(messages, tools)
        tokens = len(renderer.encode(reply_text(renderer, reply)))
        prefill, sampled, per_turn = prefill + len(prompt), sampled + tokens, per_turn + len(prompt) + tokens
        messages += [reply, result]
        last = len(prompt) + tokens
    trained = last if renderer.continues else per_turn
    return {"opening": len(renderer.prompt(opening, tools)), "turns": len(turns), "prefill": prefill,
            "sampled": sampled, "trained": trained}


def renderers() -> list[tuple[str, object, str]]:
    """(label, renderer, model) of SmolLM2's local format, and of the Qwen formats where tml-renderers is installed
    (.venv/pinned/tinker-renderers)."""
    sys.path.insert(0, str(ROOT / ".venv" / "pinned" / "tinker-renderers"))
    from aitrainsai_outer_tinker import rendering

    rows = [("SmolLM2-135M-Instruct (local)", rendering.renderer("hermes", None, local=True), "SmolLM2-135M-Instruct")]
    try:
        rows += [("Qwen3 instruct (hermes)", rendering.renderer("hermes", rendering.embedded_tokenizer("hermes")),
                  "Qwen/Qwen3-30B-A3B-Instruct-2507"),
                 ("Qwen3.6-35B-A3B (qwen3_5)",
                  rendering.renderer("qwen3_5", rendering.embedded_tokenizer("qwen3_5")), "Qwen/Qwen3.6-35B-A3B")]
    except ImportError:
        print("(tml-renderers is not installed: SmolLM2's tokenizer only)", file=sys.stderr)
    return rows


def opening_sizes(rows) -> None:
    """Per installed family, the opening prompt (messages and tool schemas) in tokens, in both views."""
    from aitrainsai import Plugins

    plugins = Plugins.load()
    print("| family | " + " | ".join(f"{label}: full | compact" for label, _, _ in rows) + " |")
    print("|---|" + "---:|---:|" * len(rows))
    with tempfile.TemporaryDirectory() as tmp:
        for family in plugins.task_families.names():
            sizes = []
            for view in ("full", "compact"):
                episode = episode_of(family, Path(tmp) / view / family, view, plugins)
                opening, tools = episode.opening_messages(), episode.tool_schemas()
                sizes.append([len(renderer.prompt(opening, tools)) for _, renderer, _ in rows])
            print(f"| {family} | " + " | ".join(f"{full:,} | {compact:,}" for full, compact in zip(*sizes)) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="calc_chain")
    parser.add_argument("--view", choices=("full", "compact"), default="full", help="the task view (loop.task_view)")
    parser.add_argument("--openings", action="store_true",
                        help="print every installed family's opening prompt size in both views instead")
    args = parser.parse_args()
    rows = renderers()
    if args.openings:
        opening_sizes(rows)
        return
    from aitrainsai_outer_tinker import costs

    with tempfile.TemporaryDirectory() as tmp:
        episode = episode_of(args.family, Path(tmp) / "runs", args.view)
        opening, tools, turns = episode.opening_messages(), episode.tool_schemas(), turns_of(episode)
    print(f"| {args.family} ({args.view} view): model (format) | opening prompt | turns | prefill | sampled | "
          "trained | USD/episode |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for label, renderer, model in rows:
        m = measure(renderer, opening, tools, turns)
        problem = costs.price_problem(model, None)
        usd = "n/a" if problem else "{:.4f}".format(costs.Tokens(prefill=m["prefill"], sampled=m["sampled"],
                                                                  trained=m["trained"]).usd(costs.prices_for(model)))
        print(f"| {label} | {m['opening']:,} | {m['turns']} | {m['prefill']:,} | {m['sampled']:,} | "
              f"{m['trained']:,} | {usd} |")


if __name__ == "__main__":
    main()
