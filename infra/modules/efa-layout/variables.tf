variable "efa_interfaces" {
  description = "EFA interfaces per instance: NetworkInfo.EfaInfo.MaximumEfaInterfaces of the instance type (p4d/p4de 4, p5/p5e 32, p5en 16, trn1 8); 0 for an instance type without EFA (one plain interface)."
  type        = number

  validation {
    condition     = var.efa_interfaces == floor(var.efa_interfaces) && var.efa_interfaces >= 0 && var.efa_interfaces <= 32
    error_message = "efa_interfaces must be a whole number from 0 to 32 (no instance type has more network cards)."
  }
}
