"""The jobs room: the job format (:mod:`~aitrainsai.jobs.job`), the validation probe (:mod:`~aitrainsai.jobs.probe`
and the child it runs in the sandbox, :mod:`~aitrainsai.jobs.probe_child`), and what crosses the wall with a job: the
environment server in the sandbox (:mod:`~aitrainsai.jobs.env_server`), the trusted side's handle on it
(:mod:`~aitrainsai.jobs.remote_env`, :mod:`~aitrainsai.jobs.sandboxed_env`), the verifiers compatibility layer
(:mod:`~aitrainsai.jobs.verifiers_env`) and the agent's workspace (:mod:`~aitrainsai.jobs.workspace`)."""
