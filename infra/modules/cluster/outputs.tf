output "region" {
  description = "Region of the cluster (a job rendered with these outputs takes it)."
  value       = local.region
}

output "vpc_id" {
  description = "ID of the cluster's VPC."
  value       = aws_vpc.this.id
}

output "subnet_id" {
  description = "ID of the instances' private subnet (in availability_zone_id)."
  value       = aws_subnet.private.id
}

output "availability_zone" {
  description = "Name of the zone of availability_zone_id in this account (us-east-1a and the like)."
  value       = aws_subnet.private.availability_zone
}

output "security_group_id" {
  description = "ID of the EFA security group (instances and the FSx file system)."
  value       = aws_security_group.efa.id
}

output "placement_group_name" {
  description = "Name of the cluster placement group."
  value       = aws_placement_group.this.name
}

output "launch_template_id" {
  description = "ID of the launch template the jobs' instances start from."
  value       = aws_launch_template.this.id
}

output "launch_template_version" {
  description = "Latest version of the launch template."
  value       = aws_launch_template.this.latest_version
}

output "efa_interfaces" {
  description = "EFA interfaces per instance in the launch template (the efa_interfaces input)."
  value       = var.efa_interfaces
}

output "instance_profile_arn" {
  description = "ARN of the instances' instance profile."
  value       = aws_iam_instance_profile.instance.arn
}

output "instance_profile_name" {
  description = "Name of the instances' instance profile."
  value       = aws_iam_instance_profile.instance.name
}

output "role_arn" {
  description = "ARN of the instances' IAM role."
  value       = aws_iam_role.instance.arn
}

output "role_name" {
  description = "Name of the instances' IAM role."
  value       = aws_iam_role.instance.name
}

output "kms_key_arn" {
  description = "ARN of the cluster's KMS key (checkpoints, FSx, ECR, logs)."
  value       = aws_kms_key.this.arn
}

output "checkpoint_bucket_name" {
  description = "Name of the checkpoint bucket (checkpoint_s3_uri = s3://<this>/<run>)."
  value       = aws_s3_bucket.checkpoints.bucket
}

output "checkpoint_bucket_arn" {
  description = "ARN of the checkpoint bucket."
  value       = aws_s3_bucket.checkpoints.arn
}

output "ecr_repository_url" {
  description = "URL of the ECR repository (image_uri = <this>:<tag>)."
  value       = aws_ecr_repository.this.repository_url
}

output "ecr_repository_arn" {
  description = "ARN of the ECR repository."
  value       = aws_ecr_repository.this.arn
}

output "log_group_name" {
  description = "The node agents' log group (one stream per host: <job>/algo-N)."
  value       = local.log_group_name
}

output "fsx_file_system_id" {
  description = "ID of the FSx for Lustre file system (null without create_fsx)."
  value       = try(aws_fsx_lustre_file_system.this[0].id, null)
}

output "fsx_file_system_arn" {
  description = "ARN of the FSx for Lustre file system (null without create_fsx)."
  value       = try(aws_fsx_lustre_file_system.this[0].arn, null)
}

output "fsx_dns_name" {
  description = "DNS name of the file system: mount <dns_name>@tcp:/<mount_name> (null without create_fsx)."
  value       = try(aws_fsx_lustre_file_system.this[0].dns_name, null)
}

output "fsx_mount_name" {
  description = "Mount name of the file system (null without create_fsx)."
  value       = try(aws_fsx_lustre_file_system.this[0].mount_name, null)
}

output "fsx_data_path" {
  description = "Folder of the file system linked to the data bucket (null without create_fsx)."
  value       = var.create_fsx ? var.fsx_data_path : null
}
