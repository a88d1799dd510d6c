"""Control rubric, verifiers v1: the classic control's reward (../rubric.py) as a @vf.reward method. It rewards long
replies, which the eval does not check: it must show no uplift."""

import verifiers.v1 as vf


class Rubric:
    @vf.reward(weight=1.0)
    async def length(self, trace: vf.Trace) -> float:
        """The completion's text (the model's replies and the tool results, as the classic completion holds them)."""
        completion = [n.message for n in trace.nodes if n.sampled or isinstance(n.message, vf.ToolMessage)]
        text = " ".join(str(getattr(m, "content", "") or "") for m in completion)
        return min(1.0, len(text) / 200)
