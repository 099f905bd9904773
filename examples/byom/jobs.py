"""examples/byom/train.py as two jobs on 2 local hosts x 2 processes, run from the repository root: MiCS p=2 with
the equivalence check, then 3 more steps tensor-parallel, resumed (resharded) from the first job's checkpoint.
docs/engine.md shows it; tests/e2e/test_engine_api_job.py runs it and checks both artifacts."""
from trainyard import Estimator

est = Estimator(entry_point="train.py", source_dir="examples/byom", instance_type="local", instance_count=2,
                processes_per_host=2, distribution={"mics": {"partition_group_size": 2}},
                checkpoint_s3_uri="s3://my-bucket/byom", hyperparameters={"steps": 5, "check": True})
est.fit()
print(est.model_data)

# 3 more steps, tensor-parallel this time: it resumes from step 5, resharded
again = Estimator(entry_point="train.py", source_dir="examples/byom", instance_type="local", instance_count=2,
                  processes_per_host=2, distribution={"tensor_parallel_degree": 2},
                  checkpoint_s3_uri="s3://my-bucket/byom", hyperparameters={"steps": 8})
again.fit()
