"""polyserve's common library: bus, state, settings, lifecycle, telemetry, infra."""
