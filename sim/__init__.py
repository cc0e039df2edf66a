"""The simulator: the real rollout scheduler (completion monitor, prompt source, partial-rollout store,
engine workers) in virtual time against simulated engines whose step costs follow a GPU's roofline
(or the CPU engine's measured costs), to predict what APRIL does on clusters we do not have.

clock.py     VirtualLoop: asyncio in virtual time, and the CPU each part of a simulation spends
hardware.py  model sizes, accelerators, and the step cost model (StepCost)
workload.py  prompts, response lengths (drawn, not sampled) and stand-in rewards, in blocks of tokens
engine.py    SimEngine: continuous batching, KV capacity, abort/resume, versions (the Engine protocol)
cluster.py   Setting, Schedule (one schedule on E engines, with the accounting checks) and the ceiling
study.py     GPU clusters from the config; learner and weight-sync time; the stated assumptions
overlap.py   the overlapped mode: a rollout that never stops on E GPUs, the learner on the rest
calibrate.py the CPU engine measured, and the simulator against jobs/bench/schedule.py's figures
config.py    SimulateConfig (`simulate.*`)
"""
