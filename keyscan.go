package idempotency

import (
	"bytes"
	"unicode/utf8"
)

// scanMessageIDs is the default key's fast path: one pass over a Pub/Sub
// envelope that checks the JSON syntax and picks out the top-level
// "message" object's "messageId" and "message_id" strings, without
// reflection or allocations beyond the two strings.
//
// It answers only where its answer is the one encoding/json.Unmarshal gives
// into messageID's struct: ok is false for anything it is not sure of (a
// syntax error, a key with an escape or a non-ASCII byte at the two levels
// it reads, an id that is not a plain string, a "message" that is absent,
// null or not an object, nesting deeper than maxScanDepth), and the caller
// then decodes with encoding/json. Where it answers it follows
// encoding/json's rules: the last of duplicate keys wins, keys match
// ignoring ASCII case, a null id leaves the field as it was, and a second
// "message" object adds to the first (the decoder reuses the struct its
// pointer already holds) unless a null in between dropped it.
//
// FuzzMessageIDScan pins the equivalence on arbitrary input.
func scanMessageIDs(data []byte) (id, alt string, ok bool) {
	s := scanner{data: data}
	s.space()
	if !s.next('{') {
		return "", "", false
	}
	present := false // message is a non-nil object
	if !s.object(func(key []byte, plain bool) bool {
		if !plain {
			return false
		}
		if !foldEqual(key, "message") {
			return s.value(1)
		}
		switch s.peek() {
		case 'n':
			if !s.literal("null") {
				return false
			}
			present, id, alt = false, "", ""
			return true
		case '{':
			s.i++
			present = true
			return s.object(func(key []byte, plain bool) bool {
				if !plain {
					return false
				}
				var field *string
				switch {
				case foldEqual(key, "messageId"):
					field = &id
				case foldEqual(key, "message_id"):
					field = &alt
				default:
					return s.value(2)
				}
				switch s.peek() {
				case 'n':
					return s.literal("null") // leaves the field as it was
				case '"':
					v, _, ok := s.str()
					if !ok || bytes.IndexByte(v, '\\') >= 0 || !utf8.Valid(v) {
						return false
					}
					*field = string(v)
					return true
				}
				return false
			})
		}
		return false
	}) {
		return "", "", false
	}
	s.space()
	if s.i != len(s.data) || !present {
		return "", "", false
	}
	return id, alt, true
}

// maxScanDepth bounds the nesting scanMessageIDs follows; deeper input goes
// to encoding/json, which has limits of its own.
const maxScanDepth = 64

// scanner reads JSON from data[i:]. Each method reports false on input it
// does not accept; the scan then stops.
type scanner struct {
	data []byte
	i    int
}

func (s *scanner) peek() byte {
	if s.i < len(s.data) {
		return s.data[s.i]
	}
	return 0
}

// next consumes c if it is the next byte.
func (s *scanner) next(c byte) bool {
	if s.peek() == c {
		s.i++
		return true
	}
	return false
}

func (s *scanner) space() {
	for s.i < len(s.data) {
		switch s.data[s.i] {
		case ' ', '\t', '\n', '\r':
			s.i++
		default:
			return
		}
	}
}

// object reads the members of an object whose '{' was consumed, through
// its '}'. For each member it reads the key and the ':' and calls member,
// which must consume the value (s.space has run before it). plain reports
// that the key has no escape and only ASCII bytes, so that key is its
// exact text.
func (s *scanner) object(member func(key []byte, plain bool) bool) bool {
	s.space()
	if s.next('}') {
		return true
	}
	for {
		s.space()
		if s.peek() != '"' {
			return false
		}
		key, plain, ok := s.str()
		if !ok {
			return false
		}
		s.space()
		if !s.next(':') {
			return false
		}
		s.space()
		if !member(key, plain) {
			return false
		}
		s.space()
		if s.next('}') {
			return true
		}
		if !s.next(',') {
			return false
		}
	}
}

// str reads a string at '"' and returns its raw bytes between the quotes;
// plain reports no escape and no byte outside ASCII.
func (s *scanner) str() (raw []byte, plain, ok bool) {
	s.i++ // '"'
	start := s.i
	plain = true
	for s.i < len(s.data) {
		c := s.data[s.i]
		switch {
		case c == '"':
			raw = s.data[start:s.i]
			s.i++
			return raw, plain, true
		case c < 0x20:
			return nil, false, false
		case c == '\\':
			plain = false
			s.i++
			switch s.peek() {
			case '"', '\\', '/', 'b', 'f', 'n', 'r', 't':
				s.i++
			case 'u':
				s.i++
				for range 4 {
					if !isHex(s.peek()) {
						return nil, false, false
					}
					s.i++
				}
			default:
				return nil, false, false
			}
		default:
			if c >= utf8.RuneSelf {
				plain = false
			}
			s.i++
		}
	}
	return nil, false, false
}

func isHex(c byte) bool {
	return '0' <= c && c <= '9' || 'a' <= c && c <= 'f' || 'A' <= c && c <= 'F'
}

// value skips one value of any kind at depth (the enclosing containers).
func (s *scanner) value(depth int) bool {
	switch c := s.peek(); {
	case c == '{':
		if depth >= maxScanDepth {
			return false
		}
		s.i++
		return s.object(func([]byte, bool) bool { return s.value(depth + 1) })
	case c == '[':
		if depth >= maxScanDepth {
			return false
		}
		s.i++
		s.space()
		if s.next(']') {
			return true
		}
		for {
			s.space()
			if !s.value(depth + 1) {
				return false
			}
			s.space()
			if s.next(']') {
				return true
			}
			if !s.next(',') {
				return false
			}
		}
	case c == '"':
		_, _, ok := s.str()
		return ok
	case c == 't':
		return s.literal("true")
	case c == 'f':
		return s.literal("false")
	case c == 'n':
		return s.literal("null")
	case c == '-' || '0' <= c && c <= '9':
		return s.number()
	}
	return false
}

func (s *scanner) literal(lit string) bool {
	if len(s.data)-s.i >= len(lit) && string(s.data[s.i:s.i+len(lit)]) == lit {
		s.i += len(lit)
		return true
	}
	return false
}

// number reads -?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?, JSON's
// number grammar.
func (s *scanner) number() bool {
	s.next('-')
	switch c := s.peek(); {
	case c == '0':
		s.i++
	case '1' <= c && c <= '9':
		s.digits()
	default:
		return false
	}
	if s.next('.') {
		if !s.digits() {
			return false
		}
	}
	if c := s.peek(); c == 'e' || c == 'E' {
		s.i++
		if c := s.peek(); c == '+' || c == '-' {
			s.i++
		}
		if !s.digits() {
			return false
		}
	}
	return true
}

// digits reads one or more decimal digits.
func (s *scanner) digits() bool {
	start := s.i
	for s.i < len(s.data) && '0' <= s.data[s.i] && s.data[s.i] <= '9' {
		s.i++
	}
	return s.i > start
}

// foldEqual reports whether key, which is ASCII, equals name ignoring ASCII
// case, as encoding/json matches a key to a field when no exact match
// exists (and no two fields here differ by case alone).
func foldEqual(key []byte, name string) bool {
	if len(key) != len(name) {
		return false
	}
	for i := range len(key) {
		a, b := key[i], name[i]
		if 'A' <= a && a <= 'Z' {
			a += 'a' - 'A'
		}
		if 'A' <= b && b <= 'Z' {
			b += 'a' - 'A'
		}
		if a != b {
			return false
		}
	}
	return true
}
