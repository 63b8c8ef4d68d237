"""The training core that belongs to no stage: what every fit does the same way, whichever stage trains.

`config.LoopConfig` (the loop's and the optimizer's knobs), `loop.run_steps` and its `Fit` protocol, `progress.Progress`
(where a fit stands, saved with every checkpoint), `optim` (AdamW's groups and the warm-up + cosine schedule, from one
LoopConfig), `step` (the ranks' agreement on a step, and a plain fit's step: agree, backward, clip, schedule, apply),
`plain_checkpoint` (a plain fit's checkpoint as safetensors tensors), `step_log` (rank 0's MLflow logger through the
outbox that travels with the run's storage: the fit outlives a tracking outage); the fault machinery any stage that
trains composes, whatever its engine: `preemption` (a worker's notices of preemption: SIGTERM, the hook's file, Ray's
drain), `attempts` (the run's journal of attempts, its heartbeat, the failures' and notices' records in its storage),
`data_wait` (the time the loop waits for data), `faults` (the failure and holds put in on purpose), `notices` (the
notice's save, training on, the guard, the watchers: composed by pretraining's worker and the adapter), `registered`
(Ray Train's registration of a checkpoint, waited for within a bound); `trainer` (the Ray Train
TorchTrainer of a job, and what the driver hands its workers) and `launch` (the driver's steps every training stage
takes, and what the workers hand back). No DeepSpeed here: pipelines.zero adds its engine, step, checkpoints and
resharding for any stage that trains with it; pipelines.adapt its adapters."""
