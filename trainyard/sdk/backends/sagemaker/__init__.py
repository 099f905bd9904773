"""The SageMaker backend: a CreateTrainingJob request from the spec, and a job handle on the service."""
