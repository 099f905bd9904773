variable "name" {
  description = "Name of the cluster: prefix of every resource name and the value of the trainyard:cluster tag. Lower-case letters, digits and hyphens."
  type        = string

  validation {
    # short enough for the derived names: bucket prefixes (37), IAM roles (64), load of suffixes
    condition     = can(regex("^[a-z][a-z0-9-]{1,22}[a-z0-9]$", var.name))
    error_message = "name must be 3-24 lower-case letters, digits or hyphens, starting with a letter and ending with a letter or digit."
  }
}

variable "availability_zone_id" {
  description = "The one zone of the cluster, by zone ID (use1-az6), not by name: zone names are shuffled per account, IDs are not. Pick one that offers the instance type (aws ec2 describe-instance-type-offerings --location-type availability-zone-id)."
  type        = string

  validation {
    condition     = can(regex("^[a-z]{2,4}[0-9]+-([a-z]+[0-9]+-)?az[0-9]+$", var.availability_zone_id))
    error_message = "availability_zone_id must be a zone ID such as use1-az6 or usw2-az4 (or a Local Zone ID such as usw2-lax1-az1), not a zone name such as us-east-1a."
  }
}

variable "vpc_cidr" {
  description = "IPv4 range of the cluster's VPC. The instances' subnet takes its first quarter; with enable_nat_gateway a small public subnet takes its last /24-equivalent."
  type        = string
  default     = "10.42.0.0/16"

  validation {
    condition     = can(cidrhost(var.vpc_cidr, 0)) && try(tonumber(split("/", var.vpc_cidr)[1]) >= 16 && tonumber(split("/", var.vpc_cidr)[1]) <= 20, false)
    error_message = "vpc_cidr must be an IPv4 CIDR block from /16 to /20, such as 10.42.0.0/16."
  }
}

variable "efa_interfaces" {
  description = "EFA interfaces per instance of the instance type the cluster runs: NetworkInfo.EfaInfo.MaximumEfaInterfaces from DescribeInstanceTypes (p4d/p4de 4, p5/p5e 32, p5en 16, trn1 8); 0 for one plain interface."
  type        = number

  validation {
    condition     = var.efa_interfaces == floor(var.efa_interfaces) && var.efa_interfaces >= 0 && var.efa_interfaces <= 32
    error_message = "efa_interfaces must be a whole number from 0 to 32."
  }
}

variable "ami_id" {
  description = "AMI of the instances. Null: the latest Deep Learning Base AMI of the region (GPU driver, EFA driver, docker with the NVIDIA runtime), from ami_ssm_parameter."
  type        = string
  default     = null

  validation {
    condition     = var.ami_id == null || can(regex("^ami-[0-9a-f]{8,17}$", var.ami_id))
    error_message = "ami_id must be null or an AMI ID such as ami-0123456789abcdef0."
  }
}

variable "ami_ssm_parameter" {
  description = "Public SSM parameter holding the AMI ID, used when ami_id is null. The default is the one the EC2 backend resolves (trainyard/sdk/backends/ec2/provision.py AMI_PARAMETER)."
  type        = string
  default     = "/aws/service/deeplearning/ami/x86_64/base-oss-nvidia-driver-gpu-amazon-linux-2023/latest/ami-id"

  validation {
    condition     = startswith(var.ami_ssm_parameter, "/")
    error_message = "ami_ssm_parameter must be an SSM parameter path starting with '/'."
  }
}

variable "root_volume_size_gib" {
  description = "Size of each instance's encrypted gp3 root volume (the image and a local copy of the S3 channels): a job's volume_size (SageMaker's default 30), raised to the AMI's root snapshot when that is larger."
  type        = number
  default     = 30

  validation {
    condition     = var.root_volume_size_gib == floor(var.root_volume_size_gib) && var.root_volume_size_gib >= 1 && var.root_volume_size_gib <= 16384
    error_message = "root_volume_size_gib must be a whole number of GiB from 1 to 16384 (gp3's maximum)."
  }
}

variable "enable_nat_gateway" {
  description = "Add a NAT gateway (with an internet gateway and a small public subnet) so the instances reach the internet: needed for images outside ECR or packages from the internet. The VPC endpoints (S3, ECR, CloudWatch Logs, EC2) cover a job whose image is in ECR without it."
  type        = bool
  default     = false
}

variable "enable_flow_logs" {
  description = "Record the VPC's flow logs (rejected and accepted traffic) in CloudWatch Logs, encrypted with the cluster's key."
  type        = bool
  default     = true
}

variable "create_fsx" {
  description = "Create the FSx for Lustre file system (PERSISTENT_2) linked to data_bucket_name. Without it the instances read S3 channels only."
  type        = bool
  default     = true
}

variable "fsx_storage_capacity_gib" {
  description = "Storage of the FSx for Lustre file system in GiB. PERSISTENT_2 takes 1200, 2400, or a multiple of 2400."
  type        = number
  default     = 1200

  validation {
    condition     = var.fsx_storage_capacity_gib == 1200 || (var.fsx_storage_capacity_gib >= 2400 && var.fsx_storage_capacity_gib % 2400 == 0 && var.fsx_storage_capacity_gib <= 2400 * 200)
    error_message = "fsx_storage_capacity_gib must be 1200, 2400 or a multiple of 2400 (up to 480000) for PERSISTENT_2."
  }
}

variable "fsx_throughput_per_tib" {
  description = "Throughput of the FSx for Lustre file system in MB/s per TiB of storage (PERSISTENT_2: 125, 250, 500 or 1000)."
  type        = number
  default     = 250

  validation {
    condition     = contains([125, 250, 500, 1000], var.fsx_throughput_per_tib)
    error_message = "fsx_throughput_per_tib must be one of 125, 250, 500, 1000 for PERSISTENT_2."
  }
}

variable "data_bucket_name" {
  description = "Existing S3 bucket with the training data. The FSx file system is linked to it (data repository association) and the instances may read it. Required when create_fsx is true."
  type        = string
  default     = null

  validation {
    condition     = var.data_bucket_name == null || can(regex("^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$", var.data_bucket_name))
    error_message = "data_bucket_name must be an S3 bucket name: 3-63 lower-case letters, digits, '.' or '-'."
  }
}

variable "data_s3_prefix" {
  description = "Prefix in data_bucket_name linked to the file system (empty: the whole bucket), without leading or trailing slash."
  type        = string
  default     = ""

  validation {
    condition     = var.data_s3_prefix == "" || can(regex("^[^/].*[^/]$|^[^/]$", var.data_s3_prefix))
    error_message = "data_s3_prefix must not start or end with '/'."
  }
}

variable "fsx_data_path" {
  description = "Folder of the file system linked to the data bucket (an fsx:// channel reads fsx://<file system id><fsx_data_path>/...)."
  type        = string
  default     = "/data"

  validation {
    condition     = can(regex("^/[A-Za-z0-9._-]+(/[A-Za-z0-9._-]+)*$", var.fsx_data_path))
    error_message = "fsx_data_path must be an absolute folder such as /data (not the root '/': one association per folder)."
  }
}

variable "fsx_auto_import_events" {
  description = "S3 events the file system imports automatically from the data bucket."
  type        = list(string)
  default     = ["NEW", "CHANGED", "DELETED"]

  validation {
    condition     = alltrue([for e in var.fsx_auto_import_events : contains(["NEW", "CHANGED", "DELETED"], e)])
    error_message = "fsx_auto_import_events may hold only NEW, CHANGED and DELETED."
  }
}

variable "fsx_auto_export_events" {
  description = "File system changes exported automatically to the data bucket (empty: the file system never writes to the bucket)."
  type        = list(string)
  default     = ["NEW", "CHANGED", "DELETED"]

  validation {
    condition     = alltrue([for e in var.fsx_auto_export_events : contains(["NEW", "CHANGED", "DELETED"], e)])
    error_message = "fsx_auto_export_events may hold only NEW, CHANGED and DELETED."
  }
}

variable "output_s3_uri" {
  description = "The jobs' output_path (s3://bucket/prefix): the instances read and write under it (model artifacts, spec.json, status objects, the uploaded code)."
  type        = string

  validation {
    condition     = can(regex("^s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/.*)?$", var.output_s3_uri))
    error_message = "output_s3_uri must be an s3:// URI such as s3://my-bucket/jobs."
  }
}

variable "read_s3_uris" {
  description = "More S3 prefixes the instances may read (S3 channels outside the data bucket, code stored elsewhere)."
  type        = list(string)
  default     = []

  validation {
    condition     = alltrue([for u in var.read_s3_uris : can(regex("^s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/.*)?$", u))])
    error_message = "read_s3_uris must hold s3:// URIs only."
  }
}

variable "write_s3_uris" {
  description = "More S3 prefixes the instances may read and write (a checkpoint_s3_uri outside the cluster's checkpoint bucket)."
  type        = list(string)
  default     = []

  validation {
    condition     = alltrue([for u in var.write_s3_uris : can(regex("^s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/.*)?$", u))])
    error_message = "write_s3_uris must hold s3:// URIs only."
  }
}

variable "ecr_repository_name" {
  description = "Name of the ECR repository created for the training image."
  type        = string
  default     = "trainyard"

  validation {
    condition     = can(regex("^[a-z0-9]+([._-][a-z0-9]+)*(/[a-z0-9]+([._-][a-z0-9]+)*)*$", var.ecr_repository_name)) && length(var.ecr_repository_name) <= 256
    error_message = "ecr_repository_name must be an ECR repository name: lower-case letters, digits, and '.', '_', '-' or '/' between them."
  }
}

variable "ecr_pull_repository_arns" {
  description = "More ECR repositories (ARNs) the instances may pull from, for an image that is not in the cluster's repository."
  type        = list(string)
  default     = []

  validation {
    condition     = alltrue([for a in var.ecr_pull_repository_arns : can(regex("^arn:aws[a-z-]*:ecr:[a-z0-9-]+:[0-9]{12}:repository/.+$", a))])
    error_message = "ecr_pull_repository_arns must hold ECR repository ARNs (arn:aws:ecr:<region>:<account>:repository/<name>)."
  }
}

variable "create_log_group" {
  description = "Create the /trainyard/jobs log group the node agents write to. False when it exists already in the region (made by the EC2 backend, or by another cluster)."
  type        = bool
  default     = true
}

variable "log_retention_days" {
  description = "Retention of the /trainyard/jobs log group and the flow logs, in days (a value CloudWatch Logs accepts)."
  type        = number
  default     = 365

  validation {
    condition     = contains([1, 3, 5, 7, 14, 30, 60, 90, 120, 150, 180, 365, 400, 545, 731, 1096, 1827, 2192, 2557, 2922, 3288, 3653], var.log_retention_days)
    error_message = "log_retention_days must be a retention CloudWatch Logs accepts (1, 3, 5, 7, 14, 30, 60, 90, 120, 150, 180, 365, 400, 545, 731, 1096, 1827, 2192, 2557, 2922, 3288 or 3653)."
  }
}

variable "checkpoint_noncurrent_days" {
  description = "Days an overwritten or deleted checkpoint object is kept (the checkpoint bucket is versioned) before it expires."
  type        = number
  default     = 30

  validation {
    condition     = var.checkpoint_noncurrent_days == floor(var.checkpoint_noncurrent_days) && var.checkpoint_noncurrent_days >= 1
    error_message = "checkpoint_noncurrent_days must be a whole number of days, at least 1."
  }
}

variable "force_destroy" {
  description = "Let terraform destroy delete the checkpoint bucket and the ECR repository with their contents. Off by default: checkpoints and images outlive the cluster."
  type        = bool
  default     = false
}

variable "tags" {
  description = "Tags added to every resource (besides trainyard:cluster)."
  type        = map(string)
  default     = {}
}
