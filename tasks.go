package idempotency

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"math"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/cloudevents/sdk-go/v2/event"

	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

// TaskEventType is the CloudEvents type of the event [TaskHandler] makes
// of a Cloud Tasks request. It is a type of this module, not one that
// Google sends: Cloud Tasks posts plain HTTP requests, not CloudEvents.
const TaskEventType = "io.github.gcp-pubsub-idempotency.cloudtasks.task"

// TaskEventSourcePrefix starts the CloudEvents source of the event
// [TaskHandler] makes of a Cloud Tasks request: the source is this prefix
// and the queue's id, as the request's queue name header gives it.
const TaskEventSourcePrefix = "//cloudtasks.googleapis.com/queues/"

// The headers in which Cloud Tasks writes a task's metadata on the
// request to an HTTP target (see
// https://cloud.google.com/tasks/docs/creating-http-target-tasks). Header
// names are case-insensitive; these are Go's canonical spellings. A task
// of an App Engine queue carries the same metadata in the X-Appengine-
// headers of the same names (X-AppEngine-QueueName, and so on), which
// [TaskHandler] reads when the request has no [TaskQueueHeader].
const (
	// TaskQueueHeader carries the queue's id (its short name, without
	// the project and location).
	TaskQueueHeader = "X-Cloudtasks-Queuename"
	// TaskNameHeader carries the task's id: the name given when it was
	// created, or an id Cloud Tasks generated.
	TaskNameHeader = "X-Cloudtasks-Taskname"
	// TaskRetryCountHeader carries how many times the task was retried
	// before this attempt: 0 on the first.
	TaskRetryCountHeader = "X-Cloudtasks-Taskretrycount"
	// TaskExecutionCountHeader carries how many attempts reached the
	// target and got a response.
	TaskExecutionCountHeader = "X-Cloudtasks-Taskexecutioncount"
	// TaskETAHeader carries the task's schedule time, in seconds since
	// the Unix epoch (with a fraction).
	TaskETAHeader = "X-Cloudtasks-Tasketa"
)

// appEngineTaskHeaders are the names of the same metadata on a request
// of an App Engine queue, in the order of taskHeaders.
var (
	cloudTasksHeaders = [...]string{TaskQueueHeader, TaskNameHeader, TaskRetryCountHeader, TaskExecutionCountHeader, TaskETAHeader}
	appEngineHeaders  = [...]string{"X-Appengine-Queuename", "X-Appengine-Taskname", "X-Appengine-Taskretrycount", "X-Appengine-Taskexecutioncount", "X-Appengine-Tasketa"}
	// taskExtensions are the CloudEvents extension attributes that keep
	// the headers' values, in the same order.
	taskExtensions = [...]string{"cloudtasksqueue", "cloudtaskstask", "cloudtasksretry", "cloudtasksexecution", "cloudtaskseta"}
)

// Task is the metadata of a Cloud Tasks request, as [ParseTask] reads it
// from the event [TaskHandler] made of the request.
type Task struct {
	// Queue is the queue's id, from [TaskQueueHeader].
	Queue string
	// Name is the task's id, from [TaskNameHeader].
	Name string
	// RetryCount is from [TaskRetryCountHeader]: 0 on the first attempt.
	RetryCount int
	// ExecutionCount is from [TaskExecutionCountHeader].
	ExecutionCount int
	// ETA is the task's schedule time, from [TaskETAHeader]; zero when
	// the request did not carry it.
	ETA time.Time
}

// ParseTask reads the task metadata that [TaskHandler] keeps in the event
// it makes of a Cloud Tasks request (as extension attributes), for a
// [KeyFunc] or a log line. An event of any other type is refused with an
// error wrapping [ErrMalformedEvent]. The event's data is the request
// body, and its data content type the request's Content-Type.
func ParseTask(e event.Event) (Task, error) {
	if e.Type() != TaskEventType {
		return Task{}, fmt.Errorf("%w: event %q (type %q) is not a Cloud Tasks request (type %q)", ErrMalformedEvent, e.ID(), e.Type(), TaskEventType)
	}
	var vals [len(taskExtensions)]string
	for i, name := range taskExtensions {
		if v, ok := e.Extensions()[name]; ok {
			vals[i] = fmt.Sprint(v)
		}
	}
	return parseTask(vals, cloudTasksHeaders)
}

// parseTask reads the metadata values vals, named (for errors) by names.
func parseTask(vals [len(taskExtensions)]string, names [len(taskExtensions)]string) (Task, error) {
	t := Task{Queue: vals[0], Name: vals[1]}
	for i, n := range []*int{&t.RetryCount, &t.ExecutionCount} {
		v := vals[2+i]
		if v == "" {
			continue
		}
		c, err := strconv.Atoi(v)
		if err != nil || c < 0 {
			return Task{}, fmt.Errorf("%w: %s %q is not a count", ErrMalformedEvent, names[2+i], v)
		}
		*n = c
	}
	if v := vals[4]; v != "" {
		secs, err := strconv.ParseFloat(v, 64)
		if err != nil || !(secs >= 0 && secs <= 1<<40) { // NaN fails both
			return Task{}, fmt.Errorf("%w: %s %q is not a time in seconds since the Unix epoch", ErrMalformedEvent, names[4], v)
		}
		whole, frac := math.Modf(secs)
		t.ETA = time.Unix(int64(whole), int64(math.Round(frac*1e6))*1e3).UTC()
	}
	return t, nil
}

// taskEvent reads a Cloud Tasks request as the event TaskHandler guards,
// and its body; status is the refusal's when err is not nil.
func taskEvent(r *http.Request) (e event.Event, body []byte, status int, err error) {
	names := cloudTasksHeaders
	if _, ok := r.Header[TaskQueueHeader]; !ok {
		if _, ok := r.Header[appEngineHeaders[0]]; ok {
			names = appEngineHeaders
		}
	}
	var vals [len(taskExtensions)]string
	for i, name := range names {
		if vals[i], err = singleHeader(r.Header, name); err != nil {
			return e, nil, http.StatusBadRequest, err
		}
	}
	if vals[0] == "" || vals[1] == "" {
		return e, nil, http.StatusBadRequest, fmt.Errorf("%w: the request has no %s and %s headers (or %s and %s, on an App Engine queue): it did not come from Cloud Tasks; nothing was claimed or run",
			ErrMalformedEvent, TaskQueueHeader, TaskNameHeader, appEngineHeaders[0], appEngineHeaders[1])
	}
	task, err := parseTask(vals, names)
	if err != nil {
		return e, nil, http.StatusBadRequest, err
	}
	if body, status, err = readBody(r); err != nil {
		return e, nil, status, err
	}
	e = event.New()
	e.SetType(TaskEventType)
	if e.SetID(task.Name); e.ID() != task.Name {
		// The SDK trims an id, as HTTP trims a header value.
		return e, nil, http.StatusBadRequest, fmt.Errorf("%w: task name %q (header %s) has spaces around it: not a Cloud Tasks task id", ErrMalformedEvent, task.Name, names[1])
	}
	if e.SetSource(TaskEventSourcePrefix + task.Queue); e.Source() != TaskEventSourcePrefix+task.Queue {
		// The SDK keeps no source that is not a URI reference; a queue id
		// (letters, digits and hyphens) always makes one.
		return e, nil, http.StatusBadRequest, fmt.Errorf("%w: queue name %q (header %s) cannot be part of a URI: not a Cloud Tasks queue id", ErrMalformedEvent, task.Queue, names[0])
	}
	if !task.ETA.IsZero() {
		e.SetTime(task.ETA)
	}
	for i, v := range vals {
		if v != "" {
			e.SetExtension(taskExtensions[i], v)
		}
	}
	e.SetDataContentType(r.Header.Get("Content-Type"))
	e.DataEncoded = body
	return e, body, 0, nil
}

// taskCall is what TaskHandler's guarded function needs of the request
// it serves: the request, its body, and where h's response goes.
type taskCall struct {
	r    *http.Request
	body []byte
	resp *taskResponse // set when h ran
}

// taskCallKey is the context key of the *taskCall of a delivery.
type taskCallKey struct{}

// taskResponse buffers h's response: nothing reaches the client until
// the claim has been completed or released. It keeps net/http's rules for
// what h writes: the header sent is the header as it was at the final
// WriteHeader (or the first Write), trailers are read when h is done, and
// a status outside 100..999 panics.
type taskResponse struct {
	header http.Header
	sent   http.Header // header as it was at the final status; nil before
	status int
	body   bytes.Buffer
}

func (w *taskResponse) Header() http.Header { return w.header }

func (w *taskResponse) Write(p []byte) (int, error) {
	if w.status == 0 {
		w.WriteHeader(http.StatusOK)
	}
	return w.body.Write(p)
}

// WriteHeader records the first final status, and the header as it is
// then. An informational status (1xx but 101, which net/http sends as a
// final one) is not buffered; a code net/http refuses panics as
// net/http's WriteHeader does, in h, so that the claim is released.
func (w *taskResponse) WriteHeader(status int) {
	if status < 100 || status > 999 {
		panic(fmt.Sprintf("invalid WriteHeader code %v", status))
	}
	if w.status != 0 || (status < 200 && status != http.StatusSwitchingProtocols) {
		return
	}
	w.status = status
	w.sent = w.header.Clone()
}

// ok reports whether h's response is a 2xx, which Cloud Tasks counts as
// the task's success.
func (w *taskResponse) ok() bool { return w.status >= 200 && w.status <= 299 }

// writeTo writes the buffered response to w.
func (w *taskResponse) writeTo(rw http.ResponseWriter) {
	h := w.sent
	if h == nil { // h wrote nothing: net/http's implicit 200 sends the header as h left it
		h = w.header
	}
	for k, vs := range h {
		rw.Header()[k] = vs
	}
	rw.WriteHeader(w.status)
	_, _ = rw.Write(w.body.Bytes())
	// Trailers, as net/http reads them when the handler returns: the
	// keys declared in the Trailer header, and http.TrailerPrefix keys.
	declared := map[string]bool{}
	for _, v := range h.Values("Trailer") {
		for _, k := range strings.Split(v, ",") {
			declared[http.CanonicalHeaderKey(strings.TrimSpace(k))] = true
		}
	}
	for k, vs := range w.header {
		if declared[k] || strings.HasPrefix(k, http.TrailerPrefix) {
			rw.Header()[k] = vs
		}
	}
}

// serveTask serves the delivery's request to serve, with the delivery's
// context, into a fresh buffer (a transactional body may be called more
// than once: only its last call's response counts). A response other
// than a 2xx is a failure, which releases the claim.
func serveTask(ctx context.Context, e event.Event, serve func(http.ResponseWriter, *http.Request)) error {
	call, _ := ctx.Value(taskCallKey{}).(*taskCall)
	if call == nil {
		return fmt.Errorf("%s event %q: a TaskHandler function ran outside TaskHandler", errPrefix, e.ID())
	}
	req := call.r.Clone(context.WithValue(ctx, taskCallKey{}, (*taskCall)(nil)))
	req.Body = io.NopCloser(bytes.NewReader(call.body))
	req.ContentLength = int64(len(call.body))
	req.GetBody = func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(call.body)), nil }
	resp := &taskResponse{header: http.Header{}}
	call.resp = resp
	serve(resp, req)
	if resp.status == 0 {
		resp.status = http.StatusOK // net/http's implicit 200
	}
	if resp.ok() {
		return nil
	}
	return withStatus(resp.status, fmt.Errorf("%s task %q of queue %q: the handler answered %d", errPrefix, e.ID(), strings.TrimPrefix(e.Source(), TaskEventSourcePrefix), resp.status))
}

// TaskStatusInProgress is the status [TaskHandler] answers a task whose
// key is held by a live claim elsewhere (another attempt of the same task
// still running): 423 Locked, without a Retry-After header. Not a 503:
// Cloud Tasks answers a 429 or a 5xx by slowing down the whole queue, and
// one task's overlapping attempts must not slow every other task. No
// Retry-After either: Google's reference names a response's Retry-After
// among what Cloud Tasks considers when it slows a queue down, so the
// queue's retry config alone spaces the retries. Not a 409, which
// [TaskHandler] keeps for a payload mismatch.
const TaskStatusInProgress = http.StatusLocked

// TaskHandler returns an http.Handler for the HTTP target of a Cloud
// Tasks queue: it runs h at most once to success per task, whatever
// Cloud Tasks redelivers (a retry after a failure or a lost response, an
// attempt that ran past the dispatch deadline, a manual "run task").
//
// It reads the task from the request's headers ([TaskQueueHeader],
// [TaskNameHeader], [TaskRetryCountHeader], [TaskExecutionCountHeader],
// [TaskETAHeader]; or their X-AppEngine- forms, on an App Engine queue),
// and makes of the request a CloudEvent of type [TaskEventType]: its id
// is the task name, its source [TaskEventSourcePrefix] and the queue id,
// its data the request body, and the task's headers its extension
// attributes ([ParseTask] reads them). It guards that event exactly as
// [Idempotent](b, opts...) guards a Pub/Sub message, through the same
// claim, lease and store: the default key ([DefaultKey], so [EventID]) is
// the source and the task name joined as [CompositeKey] joins its parts,
// so no two (queue, task) pairs share a key. The queue is named by its id
// alone (the request does not say its project or location): two queues
// of one id in different projects or locations that share a store need
// [WithKeyPrefix] to keep their keys apart. [WithKey] keys the task on
// anything else of the event, such as a field of the body.
//
// When the key is claimed, h serves the request (any method; the body
// can be read again), with the claim's context, into a buffer: the
// client sees nothing before the claim is completed or released. The
// buffer keeps net/http's rules: the header sent is the header as it was
// when h wrote its status, an informational status (1xx but 101) is not
// sent, and a WriteHeader code outside 100..999 panics in h, as under
// net/http (the claim is released, see below). A 2xx
// from h completes the claim, and h's response (status, headers, body)
// is then written. Any other status is a failure: the claim is released
// and h's response is written as it is, which Cloud Tasks retries by the
// queue's retry config (and a 429 or 5xx of h's own also slows the
// queue down). The outcomes:
//
//	h answered 2xx                           h's response       the task is done
//	duplicate (task done within the ttl)     204 No Content     the task is done; h not run
//	h answered anything else                 h's response       retried
//	task held by a live claim elsewhere      423                retried; see TaskStatusInProgress
//	task done with another payload           409                retried until max attempts
//	  (see WithFingerprint)
//	no Cloud Tasks headers, a malformed      400                retried until max attempts;
//	  one, a key the port refuses                               nothing claimed, h not run
//	body over MaxPushBody                    413                retried until max attempts
//	claim, completion or release failed      500                retried
//
// Cloud Tasks retries every status but a 2xx, 4xx ones included, until
// the queue's max attempts (or max retry duration) runs out, and then
// drops the task: a 400 or a 409 is the request's fault, and says so to
// people and monitoring, but it does not stop the retries. The guard
// itself never answers 429 or 503 (its 500, for a store that failed,
// does slow the queue).
//
// [WithPushAuth] works here as on [PushHandler]: with the verify of the
// module github.com/gcp-pubsub-idempotency/idempotency/pushauth, it checks
// the OIDC token Cloud Tasks puts on the requests of a task created with
// an OIDC token (its audience, issuer and service account). Refused
// requests are answered 401 or 403 and never claim.
//
// If h panics, the claim is released and the panic goes on into
// net/http, which drops the connection: Cloud Tasks retries the task.
// TaskHandler panics on a nil h, on what Idempotent panics on, on a
// WithPushAuth with a nil verify, and on [WithUnwrappedPush], an option
// of Pub/Sub pushes only.
func TaskHandler(b store.Backend, h http.Handler, opts ...Option) http.Handler {
	if h == nil {
		panic("idempotency.TaskHandler: nil handler")
	}
	return taskHandler("TaskHandler", opts, func() CloudEventFunc {
		return idempotent("TaskHandler", b, opts)(func(ctx context.Context, e event.Event) error {
			return serveTask(ctx, e, h.ServeHTTP)
		})
	})
}

// TxTaskHandlerFunc is an HTTP handler whose effects are writes in tx, a
// transaction of the backend's own store (see [TaskHandlerTx]).
type TxTaskHandlerFunc[Tx any] = func(w http.ResponseWriter, r *http.Request, tx Tx)

// TaskHandlerTx is [TaskHandler] for a handler whose effects are writes
// to the backend's own store (see [IdempotentTx]): h runs inside the
// backend's transaction that marks the task done, which commits only when
// h answers a 2xx; any other answer rolls it back and releases the claim.
// The store may call h more than once (an aborted transaction is run
// again): each call answers into a fresh buffer, and only the last
// call's response is written, after the commit. The statuses are
// TaskHandler's, with IdempotentTx's differences: a transaction that did
// not commit is a 500, and a claim superseded while h ran (nothing
// committed) is a 423 like any task held elsewhere.
func TaskHandlerTx[Tx any](b store.TxBackend[Tx], h TxTaskHandlerFunc[Tx], opts ...Option) http.Handler {
	if h == nil {
		panic("idempotency.TaskHandlerTx: nil handler")
	}
	return taskHandler("TaskHandlerTx", opts, func() CloudEventFunc {
		return idempotentTx("TaskHandlerTx", b, opts)(func(ctx context.Context, e event.Event, tx Tx) error {
			return serveTask(ctx, e, func(w http.ResponseWriter, r *http.Request) { h(w, r, tx) })
		})
	})
}

// taskHandler is the handler of TaskHandler (fn, for panics) serving the
// guarded function that guard builds.
func taskHandler(fn string, opts []Option, guard func() CloudEventFunc) http.Handler {
	pc := newPushConfig(opts)
	if err := pc.validate(); err != nil {
		panic("idempotency." + fn + ": " + err.Error())
	}
	if pc.unwrapped {
		panic("idempotency." + fn + ": WithUnwrappedPush is an option of PushHandler only: a Cloud Tasks request is no Pub/Sub push")
	}
	cfg := newConfig(opts)
	log := cfg.lock.log()
	guarded := guard()
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !authorized(w, r, pc.auth, log, "task") {
			return
		}
		e, body, status, err := taskEvent(r)
		if err != nil {
			log.WarnContext(r.Context(), "idempotency: refusing a Cloud Tasks request", "status", status, "error", err)
			http.Error(w, err.Error(), status)
			return
		}
		call := &taskCall{r: r, body: body}
		ctx := requestTrace(r.Context(), r)
		spanCtx := ctx
		ctx = context.WithValue(ctx, pushSpanKey{}, &spanCtx)
		err = guarded(context.WithValue(ctx, taskCallKey{}, call), e)
		switch {
		case call.resp != nil && (err == nil || !call.resp.ok()):
			if err != nil {
				log.WarnContext(spanCtx, "idempotency: the task handler failed; released the claim, passing its response on for Cloud Tasks to retry",
					"status", call.resp.status, "task", e.ID(), "queue", e.Extensions()[taskExtensions[0]])
			}
			call.resp.writeTo(w)
			return
		case err == nil:
			w.WriteHeader(http.StatusNoContent) // a duplicate
			return
		}
		status = wireStatus(err)
		switch {
		case status == http.StatusServiceUnavailable:
			// No Retry-After: Google's reference for a task's HttpRequest
			// lists it among what makes Cloud Tasks slow the whole queue
			// down, which one task's overlapping attempts must not do; the
			// queue's retry config spaces the retries.
			status = TaskStatusInProgress
		case status < 400 || status > 599:
			status = http.StatusInternalServerError // never a 2xx for a failure
		}
		if status != TaskStatusInProgress && !loggedMismatch(err) { // contention and mismatches were logged already
			log.ErrorContext(spanCtx, "idempotency: Cloud Tasks delivery failed", "status", status, "task", e.ID(), "error", err)
		}
		http.Error(w, err.Error(), status)
	})
}
