"""AWS pieces more than one backend uses: the boto3 session and its checks (EC2, SageMaker, the CLI), and
what an EC2-style job keeps on S3 and runs at boot (EC2 and Terraform)."""
