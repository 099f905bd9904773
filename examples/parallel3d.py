"""The README's 3D job: the built-in trainer's 6-layer model on 3 local hosts x 4 processes, tensor parallel 2
inside each host, 3 pipeline stages, MiCS-sharded data parallel over the other 2 ranks. tests/e2e/test_parallel3d_job.py
runs it against one process and resumes it."""
from trainyard import Estimator

est = Estimator(entry_point="trainyard.engine.train", instance_type="local", instance_count=3, processes_per_host=4,
                distribution={"tensor_parallel_degree": 2, "pipeline_parallel_degree": 3,
                              "mics": {"partition_group_size": 2}},
                hyperparameters={"model": "6l", "global_batch_size": 12, "micro_batch_size": 2, "steps": 5},
                checkpoint_s3_uri="s3://my-bucket/parallel3d")
est.fit()
print(est.latest_training_job.metrics()[-1]["loss"])
