output "instance_ids" {
  description = "Instance IDs by host index (algo-1 first)."
  value       = aws_instance.this[*].id
}

output "private_ips" {
  description = "Private IP addresses by host index; the first is the rendezvous address."
  value       = aws_instance.this[*].private_ip
}

output "hosts" {
  description = "Host name (algo-N) to instance ID."
  value       = { for i, inst in aws_instance.this : "algo-${i + 1}" => inst.id }
}

output "state_s3_uri" {
  description = "The job's state prefix: spec.json and hosts/algo-N/status.json."
  value       = var.state_s3_uri
}

output "spec_s3_uri" {
  description = "Where the job's spec.json was written."
  value       = "s3://${aws_s3_object.spec.bucket}/${aws_s3_object.spec.key}"
}
