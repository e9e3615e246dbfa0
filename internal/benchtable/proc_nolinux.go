//go:build !linux

package main

// adoptOrphans does nothing where there is no child subreaper.
func adoptOrphans() {}

// reapOrphans does nothing where there is no child subreaper.
func reapOrphans() {}
