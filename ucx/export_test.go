package ucx

// SetLogLevel lets the external tests quiet UCX in their own process.
func SetLogLevel(level string) error { return setLogLevel(level) }
