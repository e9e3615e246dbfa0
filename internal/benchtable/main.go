// Command benchtable runs every backend's BenchmarkDelivery (and the root
// package's wrapper benchmarks) one package after the other, and prints one
// Markdown table: each Lock beside the baselines measured in the same run,
// with the ratio of their deliveries per second. `make bench` runs it.
//
// A benchmark is named <Top>/<group...>/<kind>/workers=<n> (workers=1 when
// the last element is not workers=...). Kinds named lock, or wrapped and
// wrapped_<variant>, are what is measured; every other kind in the same
// group and worker count is a baseline. With -count above 1 the ratio is
// the median of the rounds' ratios (each round runs both sides back to
// back), and the range of the rounds follows it.
//
// A package whose server is missing skips its benchmark: the table gets a
// note row instead (benchtable runs without IDEMPOTENCY_REQUIRE_SERVICES).
// A benchmark that fails gets a note row too, and benchtable then exits 1
// after printing the table.
//
//	go run ./internal/benchtable [-benchtime 500ms] [-count 3] [-workers 1,16] [-timeout 3m] [-only regexp]
//	go run ./internal/benchtable -parse saved.txt   # table from saved output
package main

import (
	"bufio"
	"bytes"
	"context"
	"flag"
	"fmt"
	"math"
	"os"
	"os/exec"
	"regexp"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"time"
)

// mod is the root module's path.
const mod = "github.com/gcp-pubsub-idempotency/idempotency"

// A suite is one package's benchmarks, under one backend name.
type suite struct {
	name  string // the backend, as the table names it
	pkg   string
	bench string // -bench regexp; WORKERS stands for the -workers choice
}

// suites are run in this order. A backend's BenchmarkDelivery may measure
// more worker counts than the table shows: the -bench pattern selects the
// ones it shows (one name element per level: the SQL engines add one).
var suites = []suite{
	{"wrapper (fake.Store)", mod, "^BenchmarkDelivery$|^BenchmarkLock$/.*/.*/^workers=WORKERS$"},
	{"Redis", mod + "/store/redislock/internal/benchtest", "^BenchmarkDelivery$/.*/^workers=WORKERS$"},
	{"SQL", mod + "/store/sqllock/internal/enginetest", "^BenchmarkDelivery$/.*/.*/^workers=WORKERS$"},
	{"Datastore", mod + "/store/datastorelock", "^BenchmarkDelivery$/.*/^workers=WORKERS$"},
	{"Firestore", mod + "/store/firestorelock", "^BenchmarkDelivery$/.*/^workers=WORKERS$"},
	{"Spanner", mod + "/store/spannerlock", "^BenchmarkDelivery$/.*/^workers=WORKERS$"},
}

func main() {
	benchtime := flag.String("benchtime", "500ms", "go test -benchtime for each benchmark")
	count := flag.Int("count", 3, "go test -count: rounds of each package's benchmarks")
	workers := flag.String("workers", "1,16", "the worker counts to measure, where a benchmark measures several")
	timeout := flag.Duration("timeout", 3*time.Minute, "time budget of each package: one that runs longer is stopped, and keeps the rows it finished and a note")
	only := flag.String("only", "", "run only the suites whose name or package matches this regexp")
	parse := flag.String("parse", "", "print the table of this saved `go test -bench -v` output (suites separated by lines '# suite <name>', a line '# stopped after <duration>' for a stopped one) instead of running")
	flag.Parse()

	var outs []output
	if *parse != "" {
		data, err := os.ReadFile(*parse)
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(2)
		}
		outs = splitSaved(data)
	} else {
		re, err := regexp.Compile(*only)
		if err != nil {
			fmt.Fprintln(os.Stderr, "benchtable: -only:", err)
			os.Exit(2)
		}
		adoptOrphans()
		for _, s := range suites {
			if !re.MatchString(s.name) && !re.MatchString(s.pkg) {
				continue
			}
			s.bench = strings.ReplaceAll(s.bench, "WORKERS", "("+strings.ReplaceAll(regexp.QuoteMeta(*workers), ",", "|")+")")
			outs = append(outs, runSuite(s, *benchtime, *count, *timeout))
			reapOrphans()
		}
	}
	fmt.Print(machine(*benchtime, *count))
	rows, failed := table(outs)
	fmt.Print(render(rows))
	if failed {
		os.Exit(1)
	}
}

// output is what one suite's go test printed.
type output struct {
	suite string
	text  []byte
	err   error // go test's exit status
	// stopped is the time budget after which the run was stopped; zero
	// when it ended by itself.
	stopped time.Duration
}

// runSuite runs one package's benchmarks, echoing progress to stderr,
// and stops them after timeout (go test's own -timeout does not cover
// benchmarks).
func runSuite(s suite, benchtime string, count int, timeout time.Duration) output {
	start := time.Now()
	fmt.Fprintf(os.Stderr, "benchtable: %s (%s)...\n", s.name, s.pkg)
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, "go", "test", "-run", "^$", "-bench", s.bench, "-benchmem", "-v",
		"-benchtime", benchtime, "-count", strconv.Itoa(count), s.pkg)
	ownGroup(cmd)
	cmd.WaitDelay = 10 * time.Second
	// A missing server skips (a note row), whatever the caller's shell set.
	cmd.Env = append(os.Environ(), "IDEMPOTENCY_REQUIRE_SERVICES=", "CI=")
	var buf bytes.Buffer
	cmd.Stdout = &buf
	cmd.Stderr = &buf
	err := cmd.Run()
	fmt.Fprintf(os.Stderr, "benchtable: %s done in %s\n", s.name, time.Since(start).Round(time.Second))
	o := output{suite: s.name, text: buf.Bytes(), err: err}
	if ctx.Err() != nil {
		o.stopped = timeout
	}
	return o
}

// splitSaved splits saved output at '# suite <name>' lines.
func splitSaved(data []byte) []output {
	var outs []output
	for line := range strings.Lines(string(data)) {
		if name, ok := strings.CutPrefix(strings.TrimSpace(line), "# suite "); ok {
			outs = append(outs, output{suite: name})
			continue
		}
		if len(outs) == 0 {
			outs = append(outs, output{suite: "benchmarks"})
		}
		o := &outs[len(outs)-1]
		o.text = append(o.text, line...)
		if strings.HasPrefix(line, "FAIL") {
			o.err = fmt.Errorf("FAIL")
		}
		if d, ok := strings.CutPrefix(strings.TrimSpace(line), "# stopped after "); ok {
			o.stopped, _ = time.ParseDuration(d)
		}
	}
	return outs
}

// machine describes where the table was measured.
func machine(benchtime string, count int) string {
	uname, _ := exec.Command("uname", "-srm").Output()
	cpu := ""
	if f, err := os.ReadFile("/proc/cpuinfo"); err == nil {
		for line := range strings.Lines(string(f)) {
			if k, v, ok := strings.Cut(line, ":"); ok && strings.TrimSpace(k) == "model name" {
				cpu = ", " + strings.TrimSpace(v)
				break
			}
		}
	}
	goVersion, _ := exec.Command("go", "env", "GOVERSION").Output()
	return fmt.Sprintf("Measured %s on %s, %d CPUs%s, %s; -benchtime %s -count %d.\n\n",
		time.Now().UTC().Format("2006-01-02 15:04 MST"), strings.TrimSpace(string(uname)), runtime.NumCPU(), cpu,
		strings.TrimSpace(string(goVersion)), benchtime, count)
}

// A result is one line of benchmark output.
type result struct {
	name    string // without the -GOMAXPROCS suffix
	metrics map[string]float64
}

// perSecond is the result's deliveries per second.
func (r result) perSecond() float64 {
	if v, ok := r.metrics["deliveries/s"]; ok {
		return v
	}
	if ns := r.metrics["ns/op"]; ns > 0 {
		return 1e9 / ns
	}
	return 0
}

var procsSuffix = regexp.MustCompile(`-\d+$`)

// parseLine reads a benchmark result line: the name, the iterations, then
// value and unit pairs.
func parseLine(line string) (result, bool) {
	f := strings.Fields(line)
	if len(f) < 4 || !strings.HasPrefix(f[0], "Benchmark") || len(f)%2 != 0 {
		return result{}, false
	}
	if _, err := strconv.Atoi(f[1]); err != nil {
		return result{}, false
	}
	r := result{name: procsSuffix.ReplaceAllString(f[0], ""), metrics: map[string]float64{}}
	for i := 2; i+1 < len(f); i += 2 {
		v, err := strconv.ParseFloat(f[i], 64)
		if err != nil {
			return result{}, false
		}
		r.metrics[f[i+1]] = v
	}
	return r, true
}

// split returns a benchmark name's group (top name and the elements
// before the kind), kind and workers.
func split(name string) (group, kind string, workers int) {
	parts := strings.Split(name, "/")
	workers = 1
	if n, ok := strings.CutPrefix(parts[len(parts)-1], "workers="); ok {
		if w, err := strconv.Atoi(n); err == nil {
			workers = w
			parts = parts[:len(parts)-1]
		}
	}
	if len(parts) < 2 {
		return name, "", workers
	}
	return strings.Join(parts[:len(parts)-1], "/"), parts[len(parts)-1], workers
}

// measured reports whether kind is what a group measures (lock, or
// wrapped and its variants: wrapped_duplicate, wrapped_no_fingerprint, ...)
// rather than a baseline.
func measured(kind string) bool {
	return kind == "lock" || strings.HasPrefix(kind, "wrapped")
}

// A row is one line of the table: a measured kind beside one baseline, or
// a note.
type row struct {
	backend, group string
	workers        int
	kind, baseline string
	lock, base     float64 // median deliveries/s
	ratio          float64 // median of the rounds' ratios
	lo, hi         float64 // the rounds' range
	extra          string  // the measured side's own metrics
	note           string
}

// table turns each suite's output into rows; failed reports a benchmark
// that failed.
func table(outs []output) (rows []row, failed bool) {
	for _, o := range outs {
		rs, note, bad := suiteRows(o)
		rows = append(rows, rs...)
		if note != "" {
			rows = append(rows, row{backend: o.suite, note: note})
		}
		failed = failed || bad
	}
	return rows, failed
}

// suiteRows builds one suite's rows, and a note when it skipped or failed.
func suiteRows(o output) (rows []row, note string, failed bool) {
	type series struct {
		group, kind string
		workers     int
		runs        []result
	}
	var order []string
	byName := map[string]*series{}
	var skip, fail []string
	sc := bufio.NewScanner(bytes.NewReader(o.text))
	sc.Buffer(nil, 1<<20)
	var pending []string // the indented lines a SKIP or FAIL line follows
	for sc.Scan() {
		line := sc.Text()
		trimmed := strings.TrimSpace(line)
		if name, ok := strings.CutPrefix(trimmed, "--- SKIP: "); ok {
			skip = append(skip, withWhy(name, pending))
			pending = nil
			continue
		}
		if name, ok := strings.CutPrefix(trimmed, "--- FAIL: "); ok {
			if len(pending) > 0 || len(fail) == 0 {
				fail = append(fail, withWhy(name, pending))
			}
			pending = nil
			continue
		}
		if strings.HasPrefix(line, "    ") && trimmed != "" {
			pending = append(pending, trimmed)
			continue
		}
		pending = nil
		r, ok := parseLine(line)
		if !ok {
			continue
		}
		s := byName[r.name]
		if s == nil {
			g, k, w := split(r.name)
			s = &series{group: g, kind: k, workers: w}
			byName[r.name] = s
			order = append(order, r.name)
		}
		s.runs = append(s.runs, r)
	}
	for _, n := range order {
		m := byName[n]
		if !measured(m.kind) {
			continue
		}
		for _, bn := range order {
			b := byName[bn]
			if measured(b.kind) || b.group != m.group || b.workers != m.workers {
				continue
			}
			rounds := min(len(m.runs), len(b.runs))
			var ratios, ls, bs []float64
			for i := range rounds {
				l, bb := m.runs[i].perSecond(), b.runs[i].perSecond()
				ls, bs = append(ls, l), append(bs, bb)
				if bb > 0 {
					ratios = append(ratios, l/bb)
				}
			}
			if len(ratios) == 0 {
				continue
			}
			rows = append(rows, row{
				backend: o.suite, group: m.group, workers: m.workers, kind: m.kind, baseline: b.kind,
				lock: median(ls), base: median(bs), ratio: median(ratios),
				lo: slices.Min(ratios), hi: slices.Max(ratios), extra: extras(m.runs, b.runs),
			})
		}
	}
	switch {
	case o.stopped > 0:
		return rows, fmt.Sprintf("stopped after %s (the time budget, -timeout); the rows above are the runs that finished", o.stopped), false
	case len(fail) > 0 || (o.err != nil && len(skip) == 0):
		why := strings.Join(fail, "; ")
		if why == "" {
			why = lastLines(o.text, 3)
			if o.err != nil {
				why = o.err.Error() + ": " + why
			}
		}
		return rows, "failed: " + why, true
	case len(skip) > 0:
		return rows, "not measured (skipped): " + strings.Join(skip, "; "), false
	case len(rows) == 0:
		return rows, "no results: " + lastLines(o.text, 3), false
	}
	return rows, "", false
}

// withWhy is a skipped or failed benchmark's name and what it logged.
func withWhy(name string, why []string) string {
	if len(why) == 0 {
		return name
	}
	return name + ": " + strings.Join(why, " ")
}

// extras lists the measured side's per-delivery metrics (medians), other
// than time and throughput, and its allocations beside the baseline's.
func extras(runs, base []result) string {
	var keys []string
	for k := range runs[0].metrics {
		switch k {
		case "ns/op", "deliveries/s", "B/op":
			continue
		}
		keys = append(keys, k)
	}
	slices.Sort(keys)
	var out []string
	for _, k := range keys {
		var vs []float64
		for _, r := range runs {
			if v, ok := r.metrics[k]; ok {
				vs = append(vs, v)
			}
		}
		v := number(median(vs)) + " " + k
		var bs []float64
		for _, r := range base {
			if b, ok := r.metrics[k]; ok {
				bs = append(bs, b)
			}
		}
		switch {
		case len(bs) == 0:
		case k == "allocs/op":
			d := median(vs) - median(bs)
			sign := "+"
			if d < 0 {
				sign = ""
			}
			v += " (" + sign + number(d) + ")"
		case k == "cpu-ns/op" && median(bs) > 0:
			v += fmt.Sprintf(" (%.2fx the baseline's)", median(vs)/median(bs))
		}
		out = append(out, v)
	}
	return strings.Join(out, ", ")
}

// number prints v with three significant digits, without an exponent.
func number(v float64) string {
	if math.Abs(v) >= 100 {
		return strconv.FormatFloat(v, 'f', 0, 64)
	}
	return strconv.FormatFloat(v, 'g', 3, 64)
}

func median(vs []float64) float64 {
	s := slices.Clone(vs)
	slices.Sort(s)
	n := len(s)
	if n == 0 {
		return 0
	}
	if n%2 == 1 {
		return s[n/2]
	}
	return (s[n/2-1] + s[n/2]) / 2
}

// lastLines returns the last n non-empty lines of text, joined.
func lastLines(text []byte, n int) string {
	var out []string
	for line := range strings.Lines(string(text)) {
		if t := strings.TrimSpace(line); t != "" && !strings.HasPrefix(t, "=== ") {
			out = append(out, t)
		}
	}
	if len(out) == 0 {
		return "(no output)"
	}
	return strings.Join(out[max(0, len(out)-n):], " / ")
}

// render prints the rows as a Markdown table.
func render(rows []row) string {
	var b strings.Builder
	b.WriteString("| backend | benchmark | workers | measured | deliveries/s | baseline | deliveries/s | ratio | range | measured side, per delivery |\n")
	b.WriteString("|---|---|---:|---|---:|---|---:|---:|---|---|\n")
	for _, r := range rows {
		if r.note != "" {
			fmt.Fprintf(&b, "| %s | %s | | | | | | | | |\n", r.backend, cell(r.note))
			continue
		}
		fmt.Fprintf(&b, "| %s | %s | %d | %s | %s | %s | %s | **%.2fx** | %.2f-%.2f | %s |\n",
			r.backend, r.group, r.workers, r.kind, rate(r.lock), r.baseline, rate(r.base), r.ratio, r.lo, r.hi, r.extra)
	}
	b.WriteString("\nratio: the measured side's deliveries per second over the baseline's (above 1 is faster), the median of the rounds; range: the rounds' lowest and highest.\n")
	return b.String()
}

func rate(v float64) string {
	return strconv.FormatFloat(v, 'f', 0, 64)
}

// cell keeps a note inside one table cell.
func cell(s string) string {
	s = strings.ReplaceAll(s, "|", `\|`)
	if len(s) > 300 {
		s = s[:300] + "..."
	}
	return s
}
