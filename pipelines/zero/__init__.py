"""DeepSpeed ZeRO for any stage that trains with it, on top of the training core (pipelines.fit): `config.ZeroConfig`
(the batch, the ZeRO stage, accumulation, checkpoints: a stage's train section subclasses it), `engine` (DeepSpeed
over any objective with the core's AdamW and schedule; the full weights of a partitioned module), `fit.DeepSpeedFit`
(the engine as the loop's Fit: one step, or feature-cache accumulation, applied only where the loss is finite on every
rank), `checkpoints.Checkpoints` (when a save is due and the one order of every save, the loop's Saver and a voter),
`checkpoint_files` (a checkpoint's shards saved behind training or at once through Ray Train, restored weights-only),
`reshard` (a checkpoint of another world size, through DeepSpeed's universal form) and `snapshot_sweep` (what killed
uploads left on the nodes, removed at a job's start). Nothing here knows pretraining's model, data or evaluation:
pipelines.pretrain composes these with the core's notices, attempts and loop."""
