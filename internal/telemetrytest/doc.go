// Package telemetrytest holds the tests of the root package's
// OpenTelemetry spans and metrics, read back with the OpenTelemetry SDK's
// in-memory exporters. It is a module of its own, and holds nothing but
// tests, so that the SDK stays out of the module graph of a program that
// imports the root package: that program needs the OpenTelemetry API
// only.
package telemetrytest
