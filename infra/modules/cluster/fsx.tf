# FSx for Lustre PERSISTENT_2 in the instances' subnet and EFA security group, linked to the data
# bucket by a data repository association: objects appear as files under fsx_data_path (imported
# lazily on first read), files written there go back to the bucket. The user data mounts it with
# `mount -t lustre -o relatime,flock <dns_name>@tcp:/<mount_name> /fsx/<file system id>`.

resource "aws_fsx_lustre_file_system" "this" {
  count                       = var.create_fsx ? 1 : 0
  deployment_type             = "PERSISTENT_2"
  storage_type                = "SSD"
  storage_capacity            = var.fsx_storage_capacity_gib
  per_unit_storage_throughput = var.fsx_throughput_per_tib
  file_system_type_version    = "2.15"
  subnet_ids                  = [aws_subnet.private.id]
  security_group_ids          = [aws_security_group.efa.id]
  kms_key_id                  = aws_kms_key.this.arn
  data_compression_type       = "LZ4" # training data (tokens, text) compresses; less to move over the wire
  copy_tags_to_backups        = true
  tags                        = merge(local.tags, { Name = var.name })

  lifecycle {
    precondition {
      condition     = var.data_bucket_name != null
      error_message = "create_fsx needs data_bucket_name: the file system is linked to the data bucket."
    }
  }
}

resource "aws_fsx_data_repository_association" "data" {
  count                            = var.create_fsx ? 1 : 0
  file_system_id                   = aws_fsx_lustre_file_system.this[0].id
  file_system_path                 = var.fsx_data_path
  data_repository_path             = var.data_s3_prefix == "" ? "s3://${var.data_bucket_name}" : "s3://${var.data_bucket_name}/${var.data_s3_prefix}"
  batch_import_meta_data_on_create = true # the listing of what is already in the bucket, at creation
  delete_data_in_filesystem        = false

  s3 {
    auto_import_policy {
      events = var.fsx_auto_import_events
    }
    auto_export_policy {
      events = var.fsx_auto_export_events
    }
  }

  tags = local.tags
}
