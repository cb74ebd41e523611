"""The wire contract: message types, error codes, request validation, queue names."""
