"""Control rubric: rewards long replies, which the eval does not check. It must show no uplift."""

import verifiers as vf


def length(completion, **kwargs) -> float:
    text = " ".join(str(getattr(m, "content", "") or "") for m in completion)
    return min(1.0, len(text) / 200)


def build_rubric(parser):
    return vf.Rubric(funcs=[length], weights=[1.0], parser=parser)
