//go:build tools

package function

// The Cloud Run functions buildpack generates a main that imports
// funcframework. When the source ships a vendor directory, that package
// must be in it too; this import (never compiled: the tools tag is never
// set) is what makes `go mod vendor` include it.
import _ "github.com/GoogleCloudPlatform/functions-framework-go/funcframework"
