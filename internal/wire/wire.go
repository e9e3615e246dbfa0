// Package wire holds the one mapping from what a CloudEvent function
// returns to the HTTP status that goes on the wire, shared by the
// idempotency wrappers and the pubsubtest package.
package wire

import (
	"errors"
	"net/http"

	"github.com/cloudevents/sdk-go/v2/protocol"
	cehttp "github.com/cloudevents/sdk-go/v2/protocol/http"
)

// Status is the status the functions framework (cloudevents sdk-go
// v2.16's receive handler) writes for err, a CloudEvent function's return
// value: 200 for nil or an ACK, the status of a *cehttp.Result found with
// errors.As when it lies in 101..599 (else 200), 500 for any other error;
// 0 for a nil *cehttp.Result, on which the framework would panic.
func Status(err error) int {
	var res *cehttp.Result
	switch {
	case err == nil:
		return http.StatusOK
	case errors.As(err, &res):
		switch {
		case res == nil:
			return 0
		case res.StatusCode > 100 && res.StatusCode < 600:
			return res.StatusCode
		}
		return http.StatusOK
	case protocol.IsACK(err):
		return http.StatusOK
	}
	return http.StatusInternalServerError
}
