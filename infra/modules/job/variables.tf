variable "job_name" {
  description = "The job's name (JobSpec.job_name): the trainyard:job tag the node agents find each other by."
  type        = string

  validation {
    condition     = can(regex("^[A-Za-z0-9](-*[A-Za-z0-9])*$", var.job_name)) && length(var.job_name) <= 63
    error_message = "job_name must be 1-63 letters, digits and hyphens, starting and ending with a letter or digit."
  }
}

variable "instance_type" {
  description = "EC2 instance type, without SageMaker's ml. prefix (p5.48xlarge)."
  type        = string

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]*\\.[a-z0-9]+$", var.instance_type)) && !startswith(var.instance_type, "ml.")
    error_message = "instance_type must be an EC2 instance type such as p5.48xlarge (no ml. prefix)."
  }
}

variable "instance_count" {
  description = "Number of instances (hosts algo-1..N)."
  type        = number

  validation {
    condition     = var.instance_count == floor(var.instance_count) && var.instance_count >= 1 && var.instance_count <= 1024
    error_message = "instance_count must be a whole number from 1 to 1024."
  }
}

variable "launch_template_id" {
  description = "The cluster's launch template (modules/cluster output launch_template_id): AMI, EFA interfaces, IMDSv2, placement group, instance profile."
  type        = string

  validation {
    condition     = can(regex("^lt-[0-9a-f]{8,17}$", var.launch_template_id))
    error_message = "launch_template_id must be a launch template ID such as lt-0123456789abcdef0."
  }
}

variable "launch_template_version" {
  description = "Version of the launch template: a number, $Latest or $Default."
  type        = string
  default     = "$Default"

  validation {
    condition     = can(regex("^([0-9]+|\\$Latest|\\$Default)$", var.launch_template_version))
    error_message = "launch_template_version must be a version number, $Latest or $Default."
  }
}

variable "efa_interfaces" {
  description = "Network interfaces per instance in the launch template (modules/cluster output efa_interfaces; 0 stands for one plain interface): each one gets the job's tags."
  type        = number

  validation {
    condition     = var.efa_interfaces == floor(var.efa_interfaces) && var.efa_interfaces >= 0 && var.efa_interfaces <= 32
    error_message = "efa_interfaces must be a whole number from 0 to 32."
  }
}

variable "use_spot" {
  description = "Launch spot instances (one-time requests, terminated on interruption). Nothing relaunches an interrupted Terraform job: apply again."
  type        = bool
  default     = false
}

variable "user_data" {
  description = "The instances' user data: the script trainyard/sdk/backends/aws/userdata.py render_user_data writes (mount FSx, pull the image, run the node agent, power off). Identical for every instance."
  type        = string

  validation {
    condition     = startswith(var.user_data, "#!") && length(var.user_data) <= 16384
    error_message = "user_data must be a script starting with #! and at most 16384 bytes (EC2's limit)."
  }
}

variable "state_s3_uri" {
  description = "The job's state prefix, <output_path>/<job>/trainyard: spec.json goes there and the nodes write hosts/algo-N/status.json under it."
  type        = string

  validation {
    condition     = can(regex("^s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]/(.+/)?[A-Za-z0-9-]+/trainyard$", var.state_s3_uri))
    error_message = "state_s3_uri must be s3://<bucket>/[<prefix>/]<job>/trainyard."
  }
}

variable "spec_json" {
  description = "The job's JobSpec as JSON (JobSpec.to_json): the node agents read it from <state_s3_uri>/spec.json."
  type        = string

  validation {
    condition     = can(jsondecode(var.spec_json).job_name)
    error_message = "spec_json must be a JobSpec in JSON, with its job_name."
  }
}

variable "code_archive_path" {
  description = "Local path of the job's sourcedir.tar.gz, uploaded to code_s3_uri (null: the entry point is an installed module and nothing is uploaded)."
  type        = string
  default     = null

  validation {
    condition     = var.code_archive_path == null || fileexists(coalesce(var.code_archive_path, "-"))
    error_message = "code_archive_path must be null or an existing file (the job's sourcedir.tar.gz)."
  }
}

variable "code_s3_uri" {
  description = "Where the code archive goes (JobSpec.code_uri); with code_archive_path."
  type        = string
  default     = null

  validation {
    condition     = var.code_s3_uri == null || can(regex("^s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]/.+$", var.code_s3_uri))
    error_message = "code_s3_uri must be null or an s3:// object URI."
  }
}

variable "tags" {
  description = "More tags for the instances, their volumes and their network interfaces."
  type        = map(string)
  default     = {}
}
