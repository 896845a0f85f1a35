package trace

import (
	"bytes"
	"os"
	"reflect"
	"strings"
	"testing"
)

// smallMooncake is the configuration of testdata/mooncake_small.jsonl.
var smallMooncake = MooncakeGenConfig{Seed: 7, Requests: 40, InputMean: 3000, OutputMean: 40,
	Prefixes: 4, SharedFrac: 0.6, IntervalMean: 20}

// TestMooncakeTestdata pins the generator: the committed small trace is
// exactly what GenerateMooncake makes, and it reads back unchanged.
func TestMooncakeTestdata(t *testing.T) {
	want := GenerateMooncake(smallMooncake)
	var buf bytes.Buffer
	if err := WriteMooncake(&buf, want); err != nil {
		t.Fatal(err)
	}
	if os.Getenv("KVLEASE_UPDATE_TESTDATA") != "" {
		if err := os.WriteFile("testdata/mooncake_small.jsonl", buf.Bytes(), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	file, err := os.ReadFile("testdata/mooncake_small.jsonl")
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(file, buf.Bytes()) {
		t.Fatal("testdata/mooncake_small.jsonl differs from GenerateMooncake's output (KVLEASE_UPDATE_TESTDATA=1 rewrites it)")
	}
	got, err := ReadMooncake(bytes.NewReader(file))
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(got, want) {
		t.Fatal("read back differs")
	}
	shared := 0
	for _, r := range got[1:] {
		if r.HashIDs[0] == got[0].HashIDs[0] {
			shared++
		}
	}
	if shared == 0 {
		t.Fatal("no request shares the first one's prefix")
	}
}

func TestReadMooncakeErrors(t *testing.T) {
	for _, tc := range []struct{ name, in, want string }{
		{"ids short", `{"timestamp":0,"input_length":1025,"output_length":1,"hash_ids":[1,2]}`, "want 3"},
		{"ids long", `{"timestamp":0,"input_length":10,"output_length":1,"hash_ids":[1,2]}`, "want 1"},
		{"time back", `{"timestamp":5,"input_length":1,"output_length":1,"hash_ids":[1]}
{"timestamp":4,"input_length":1,"output_length":1,"hash_ids":[1]}`, "before"},
		{"no output", `{"timestamp":0,"input_length":1,"output_length":0,"hash_ids":[1]}`, "≥ 1"},
		{"negative id", `{"timestamp":0,"input_length":1,"output_length":1,"hash_ids":[-1]}`, "negative"},
		{"not json", `{"timestamp":`, "object 1"},
	} {
		if _, err := ReadMooncake(strings.NewReader(tc.in)); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: err %v, want it to mention %q", tc.name, err, tc.want)
		}
	}
	// Extra keys in published traces are ignored.
	reqs, err := ReadMooncake(strings.NewReader(`{"timestamp":3,"input_length":513,"output_length":2,"hash_ids":[7,8],"model":"x"}`))
	if err != nil || len(reqs) != 1 || reqs[0].HashIDs[1] != 8 {
		t.Fatalf("%v %v", reqs, err)
	}
}

// TestFromMooncake: prompts sharing leading hash ids share exactly those
// blocks' tokens; the conversion validates and round-trips through Write.
func TestFromMooncake(t *testing.T) {
	reqs := []MooncakeRequest{
		{Timestamp: 0, InputLength: 1100, OutputLength: 3, HashIDs: []int64{1, 2, 3}},
		{Timestamp: 25, InputLength: 1024, OutputLength: 5, HashIDs: []int64{1, 2}},
		{Timestamp: 40, InputLength: 600, OutputLength: 5, HashIDs: []int64{1, 9}},
	}
	tr := FromMooncake(reqs, 10)
	if err := tr.Validate(); err != nil {
		t.Fatal(err)
	}
	if a := []int{tr.Requests[0].Arrival, tr.Requests[1].Arrival, tr.Requests[2].Arrival}; !reflect.DeepEqual(a, []int{0, 2, 4}) {
		t.Fatalf("arrivals %v", a)
	}
	toks := make([][]int32, 3)
	for i, r := range tr.Requests {
		toks[i] = r.Prompt.AppendTokens(nil)
		if len(toks[i]) != reqs[i].InputLength || r.Prompt.Len() != reqs[i].InputLength {
			t.Fatalf("request %d: %d tokens", i, len(toks[i]))
		}
	}
	common := func(a, b []int32) int {
		n := 0
		for n < min(len(a), len(b)) && a[n] == b[n] {
			n++
		}
		return n
	}
	if n := common(toks[0], toks[1]); n != 1024 {
		t.Fatalf("requests 0 and 1 share %d tokens, want 1024", n)
	}
	if n := common(toks[0], toks[2]); n < 512 || n > 520 {
		t.Fatalf("requests 0 and 2 share %d tokens, want 512 (and a chance match or few)", n)
	}
	var buf bytes.Buffer
	if err := Write(&buf, tr); err != nil {
		t.Fatal(err)
	}
	back, err := Read(&buf)
	if err != nil || !reflect.DeepEqual(back.Requests, tr.Requests) {
		t.Fatalf("round trip: %v", err)
	}
	bad := *tr
	bad.Requests = append([]Request(nil), tr.Requests...)
	bad.Requests[0].Prompt.HashLen = 5000
	if bad.Validate() == nil {
		t.Fatal("a hash_len that disagrees with the ids validated")
	}
}

func TestGenerateMooncakeShape(t *testing.T) {
	reqs := GenerateMooncake(ProductionMooncake())
	total, shared := 0, 0
	for _, r := range reqs {
		if err := r.check(0); err != nil {
			t.Fatal(err)
		}
		total += r.InputLength
		for _, id := range r.HashIDs {
			if id < int64(ProductionMooncake().Prefixes)<<20 {
				shared++
			}
		}
	}
	mean := total / len(reqs)
	if mean < 10000 || mean > 14000 {
		t.Fatalf("mean prompt %d tokens, want about 12,000", mean)
	}
	blocks := 0
	for _, r := range reqs {
		blocks += len(r.HashIDs)
	}
	if f := float64(shared) / float64(blocks); f < 0.35 || f > 0.65 {
		t.Fatalf("shared share %.2f, want about 0.5", f)
	}
}
