"""The job description shared by every layer: the validated spec, the instance catalog, storage URIs and
primitives, and the errors a user sees. Imports nothing from `trainyard.sdk` or `trainyard.container`."""
