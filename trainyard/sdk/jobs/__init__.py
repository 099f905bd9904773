"""A job as the SDK sees it whatever runs it: the shared handle (`TrainingJob`), its folder and status
document, its log, live progress, metrics and report. It imports no backend."""
