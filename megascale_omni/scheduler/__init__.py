"""Reference elastic scheduler: pools, jobs, the policy, its baselines and a
trace simulator that runs the same policy code (docs/scheduler.md).

The policy is a pure function of a snapshot plus its own hysteresis memory;
actuation goes through :class:`~megascale_omni.scheduler.model.Actuator`,
which the simulator and the live actuator (``actuator.py``, driven by
``omni-sched run``, ``live_loop.py``) implement.
"""
